"""Ctrl-C in a terminal goes to its whole foreground process group, and so does the SIGTERM that
Kubernetes, SLURM's scancel, `timeout` and most job runners send: the driver, and the processes
the driver started there (the local Ray cluster's GCS, raylet, agents and autoscaler monitor, the
reward workers). The driver turns either into a stop after the current step, with a checkpoint,
and then shuts those processes down in order (`rlsys.run.lifecycle`), so they must not act on it:
the local Ray cluster's processes start in process groups of their own, which no group signal
reaches; the reward workers start with SIGINT and SIGTERM blocked."""

from __future__ import annotations

import functools
import signal
import subprocess
from contextlib import contextmanager
from multiprocessing import resource_tracker

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def children_shielded_from_stop_signals():
    """Processes started from this thread inside the block never receive SIGINT or SIGTERM. They
    are blocked, not ignored: a blocked signal stays blocked across fork and exec, and installing a
    handler does not unblock it (Ray's runtime-env agent, autoscaler monitor, GCS and raylet
    install their own, and exit on them). Their shutdown still works: Ray's falls back to SIGKILL,
    the reward pool's workers exit on its request. The driver itself still gets both signals
    meanwhile: its other threads do not block them."""
    # multiprocessing's resource tracker (spawn workers need one) unblocks both signals in the thread
    # that starts it (CPython 3.11's ensure_running): started here first, it cannot undo the block.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def children_in_process_groups_of_their_own():
    """Processes started with subprocess.Popen inside the block (ray.init's GCS, raylet, agents,
    monitors: Ray passes no process-group option of its own) lead new process groups, so a signal
    to the driver's group never reaches them, whatever handlers they install, while their own
    SIGTERM still works: ray.shutdown's terminate-then-wait ends them at once. (Blocking SIGTERM in
    them instead made every ray.shutdown wait out its 1 s grace per process: 5.2 s against 1.5 s.)
    Patches Popen for the block's duration; `process_group` is Popen's own option (Python 3.11)."""
    original = subprocess.Popen.__init__

    @functools.wraps(original)
    def in_own_group(self, *args, **kwargs):
        if kwargs.get("process_group") is None and not kwargs.get("start_new_session"):
            kwargs["process_group"] = 0
        original(self, *args, **kwargs)

    subprocess.Popen.__init__ = in_own_group
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original


def take_sigterm_again() -> None:
    """For a process below a shielded one that is itself stopped with SIGTERM, in a session of its
    own where no group signal reaches it (an engine's SGLang server, a reaper): it inherited SIGTERM
    blocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
