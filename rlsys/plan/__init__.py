"""`rlsys plan`: what each device and host holds in each phase of a step, and whether it fits;
the run checks the same plan before it starts anything (rlsys/run/placement_checks.py)."""
