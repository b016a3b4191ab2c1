"""`python -m rlsys.cli`."""

from rlsys.cli.main import entry

entry()
