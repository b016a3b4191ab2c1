"""`rlsys engines up|status|down`: standing engine sets that outlive the runs attaching to them.
The set itself (its actors, record and lease) is rlsys/rollout/standing.py; a run's side of it, the
attachment, is rlsys/run/attach.py."""
