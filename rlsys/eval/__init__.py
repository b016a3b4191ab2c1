"""`rlsys eval`: a checkpoint or a model evaluated on the run's eval sets, on its own engines or
on a standing set."""
