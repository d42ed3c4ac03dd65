"""Keep the engine's compute threads ahead of the serving threads on a shared machine.

A step runs its kernels on an OpenMP team of `engine.num_threads` threads and waits at a barrier
after each one. When an event loop, a gRPC poller or a client takes one of the team's cores, the
rest of the team spins at that barrier until the preempted thread runs again: on two cores, a
process using a third of one core made decode steps ~3-4x slower at the same load, and the same
process at nice 10 cost ~1.3x (bench notes in issue 10). Serving threads need little CPU but run
often, so they give way: once a component has started, its event-loop thread raises its own nice
value, and threads it starts later inherit it. The engine thread and its OpenMP team, started
before, keep theirs. Raising a nice value needs no privilege; Linux applies it per thread.

Giving way in share must not mean waiting in line. Linux's EEVDF scheduler lets a running thread
finish its slice (1.4 ms by default here) before a woken one of the same class takes its core,
and checks at the next tick, so a token woken into the router or a client while the engine's
team holds both cores waited ~3.5 ms in about half of the first tokens of a colocated worker
(HTTP, 50M model, traced: 12 of 24 requests). A thread may ask for a shorter slice (Linux 6.12
on), which lets it preempt one that runs a longer one: serving processes ask for
`process.serving_slice_us` from their first thread, so every thread they start inherits it, and
the engine thread returns to the default before it builds the engine and its team. With 100 us,
5 of 24 requests still met such a wait (the router's event loop, at its lower weight) and the
time outside the prefill step fell from 6.6-7.0 to 5.0-5.4 ms on average; at 2 and 3 req/s the
TTFT and TPOT percentiles did not move beyond the run-to-run noise. Setting a slice needs no
privilege; kernels before 6.12 have no per-thread slice for these threads and ignore the field
(only Linux 6.18 was tried here).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
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


class _SchedAttr(ctypes.Structure):
    """struct sched_attr (linux/sched/types.h), as far as SCHED_OTHER reads it."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64)]


# sched_setattr / sched_getattr by architecture; elsewhere slices are left alone.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_SCHED_OTHER = 0


@functools.cache  # the C library's entry points do not change while the process runs
def _libc_function(name: str):
    """The C library's `name` (errno kept), or None where there is none."""
    if os.name != "posix":
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def _sched_attr_calls():
    nums = _SYSCALLS.get(platform.machine()) if hasattr(os, "getpriority") else None
    syscall = _libc_function("syscall") if nums is not None else None
    return (syscall, nums) if syscall is not None else None


def set_thread_slice(us: float) -> bool:
    """Ask for a scheduler slice of `us` microseconds for the calling thread (0: the kernel's
    default); threads it starts later inherit it. Keeps the thread's policy and nice value. Only
    SCHED_OTHER threads are touched (a real-time one stays as it is). Whether the kernel took it."""
    calls = _sched_attr_calls()
    if calls is None:
        return False
    syscall, (set_nr, get_nr) = calls
    attr = _SchedAttr()
    if syscall(get_nr, 0, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0 or attr.sched_policy != _SCHED_OTHER:
        return False
    new = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=_SCHED_OTHER, sched_nice=attr.sched_nice,
                     sched_runtime=int(us * 1000))
    if syscall(set_nr, 0, ctypes.byref(new), 0) != 0:
        log.debug("sched_setattr refused a %s us slice (errno %d)", us, ctypes.get_errno())
        return False
    return True


def thread_slice_us(tid: int = 0) -> float | None:
    """The scheduler slice of thread `tid` (0: the caller) in microseconds, or None where it
    cannot be read. The kernel reports its default for threads that asked for none."""
    calls = _sched_attr_calls()
    if calls is None:
        return None
    syscall, (_, get_nr) = calls
    attr = _SchedAttr()
    if syscall(get_nr, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return attr.sched_runtime / 1000


_PR_SET_NAME = 15  # prctl(2)


def name_native_thread(name: str) -> bool:
    """Give the calling thread `name` (cut to Linux's 15 bytes) where the OS shows it: `top -H`,
    `ps -L`, py-spy and /proc/<pid>/task/<tid>/comm. Python 3.11 names threads only for itself.
    Threads started later (an OpenMP team) inherit it. Whether the name took."""
    prctl = _libc_function("prctl") if platform.system() == "Linux" else None
    return prctl is not None and prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
