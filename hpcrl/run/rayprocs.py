"""A local run's Ray processes ride out a SIGTERM to the run's process group, and stop at once at the end.

``scancel`` of a run inside an allocation, or ``kill -TERM -PGID``, signals every process of the run:
the driver saves the step it is in (``run/preempt.py``), but Ray's GCS and raylet install SIGTERM
handlers of their own (an inherited "ignore" does not last) and stop, the raylet's object store with
them: a step that then moves an object through it, or starts an actor, fails, and Ray's client aborts
the driver 60 s after losing the GCS. So ``ray.init`` starts them with SIGTERM *blocked* (a blocked
signal stays blocked across fork and exec, whatever handler the process installs), as the Slurm path's
reaper does (``launch/reaper.py --hold-term``).

Their SIGTERM then never arrives, and ``ray.shutdown`` would wait 1 s on each before its SIGKILL
(+4-5 s a run, measured); ``shutdown`` here disconnects the driver first, then SIGKILLs them itself
(0.4 s): the driver's job has ended, its actors are gone, and nothing they hold outlives the run."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

_HELD: list[Any] = []
"""The Ray node whose processes were started with SIGTERM blocked (at most one: this driver's)."""


def start_holding_term(start: Callable[[], None]) -> None:
    """``start()`` (``ray.init`` of a new local cluster) with SIGTERM blocked in the processes it starts.
    A SIGTERM that arrives meanwhile waits, and then reaches the handler that was in place before
    (``ray.init`` puts its own in, which dumps the stack and aborts)."""
    import ray

    main = threading.current_thread() is threading.main_thread()  # signal.signal: main thread only
    previous = signal.getsignal(signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # this thread's: its children inherit it
    try:
        start()
        _HELD[:] = [ray._private.worker._global_node]
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def shutdown() -> None:
    """``ray.shutdown()``; for a node started by ``start_holding_term``, its processes SIGKILLed after
    the driver has disconnected (their SIGTERM is blocked)."""
    import ray

    node = _HELD.pop() if _HELD else None
    if node is not None and ray._private.worker._global_node is node:
        ray._private.worker._global_node = None  # ray.shutdown: disconnect only, kill nothing
        ray.shutdown()
        node.kill_all_processes(check_alive=False, allow_graceful=False)
    else:
        ray.shutdown()
