"""Errors that end a run with a message for the user (the CLI prints them without a traceback)."""


class RunFailed(RuntimeError):
    """The run stopped on bad input or a broken component; the message says which."""
