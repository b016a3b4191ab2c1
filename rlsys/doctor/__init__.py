"""`rlsys doctor`: the machines and the cluster checked for a run, as a table or one JSON document."""
