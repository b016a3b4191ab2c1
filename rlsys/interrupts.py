"""Ctrl-C in a terminal goes to its whole foreground process group: the driver, and the processes
the driver started there (the local Ray cluster's GCS, raylet, agents and autoscaler monitor, the
reward workers). The driver turns it into a stop after the current step, with a checkpoint
(`rlsys.coordinator`), so those processes must not act on it: they start with SIGINT blocked."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def children_shielded_from_ctrl_c():
    """Processes started from this thread inside the block never receive SIGINT. It is blocked,
    not ignored: a blocked signal stays blocked across fork and exec, and installing a handler does
    not unblock it (Ray's runtime-env agent and autoscaler monitor install their own, and exit on
    it). The driver itself still gets a Ctrl-C meanwhile: its other threads do not block it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
