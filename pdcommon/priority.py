"""Keep the engine's compute threads ahead of the serving threads on a shared machine.

A step runs its kernels on an OpenMP team of `engine.num_threads` threads and waits at a barrier
after each one. When an event loop, a gRPC poller or a client takes one of the team's cores, the
rest of the team spins at that barrier until the preempted thread runs again: on two cores, a
process using a third of one core made decode steps ~3-4x slower at the same load, and the same
process at nice 10 cost ~1.3x (bench notes in issue 10). Serving threads need little CPU but run
often, so they give way: once a component has started, its event-loop thread raises its own nice
value, and threads it starts later inherit it. The engine thread and its OpenMP team, started
before, keep theirs. Raising a nice value needs no privilege; Linux applies it per thread.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def lower_thread_priority(increment: int) -> int | None:
    """Raise the calling thread's nice value by `increment` (capped at 19); return the new value,
    or None when nothing changed (increment 0, or a platform without per-thread priorities)."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()
    try:
        value = min(os.getpriority(os.PRIO_PROCESS, tid) + increment, 19)
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as e:  # a sandbox without setpriority: serve anyway, only less well under load
        log.warning("could not lower the priority of the serving thread: %s", e)
        return None
    return value


def restore_priority(target: int) -> int | None:
    """Bring the calling thread's nice value down to `target`; threads it starts later inherit it.

    Ray starts its worker processes at nice 15 (its `worker_niceness`), so an engine hosted in a
    Ray actor would lose its cores to every process at 0: the client, Ray's own daemons. Its
    OpenMP team then stalls at barriers, the effect described above: on 2 cores at 2 req/s, TPOT
    p50 44-75 ms served at nice 15 against 22 ms for the same engine in a plain process.
    Lowering a nice value needs CAP_SYS_NICE (root) or an RLIMIT_NICE allowance; without either,
    warn and serve at the value Ray chose. Returns the new value, or None when unchanged."""
    if not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if current <= target:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:
        log.warning("this process runs at nice %d and cannot return to %d (%s): the engine will yield its cores "
                    "to other processes under load. Ray starts workers at nice 15; start Ray with "
                    "RAY_worker_niceness=0 in the environment of `ray start`", current, target, e)
        return None
    return target
