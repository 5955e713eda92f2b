"""The Gloo process group that carries a cgx group's exact path and its links to other
hosts, with its socket thread kept from preempting the threads that feed it.

Gloo's TCP transport moves data on a device thread ("gloo_tcp_loop") that handles each
socket's events under the connection's lock, and skips the event when it cannot take the
lock at once. The event stays pending (epoll is level-triggered), so the thread polls
again at once, and keeps polling while the lock's holder waits for a CPU. Where ranks
outnumber free cores, the holder is often the thread the loop thread has just
preempted: cgx's worker (or Gloo's own) posting a send or a receive on that connection,
woken data having arrived on the same core. The loop then spins for its whole time
slice, 1.5-4 ms on the 2-core development VM, two or three times in some 1 MiB
allreduces (docs/benchmarks.md). A SCHED_BATCH thread does not preempt on wake-up, so the
holder finishes its post and sleeps first; the loop thread still runs at once on an idle
core, and at its fair share otherwise.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["new_gloo_group", "loop_threads"]

_LOOP_THREAD = "gloo_tcp_loop"


def new_gloo_group(store: dist.Store, rank: int, size: int,
                   timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A ProcessGroupGloo on `store` whose device threads (the ones its creation started)
    are scheduled SCHED_BATCH, where Linux allows it; elsewhere a plain one."""
    before = loop_threads()
    group = dist.ProcessGroupGloo(store, rank, size, timeout)
    if hasattr(os, "sched_setscheduler"):
        for tid in loop_threads() - before:
            try:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                pass  # a seccomp profile that refuses it: the group works as Gloo's default
    return group


def loop_threads() -> set[int]:
    """This process's Gloo device threads, by thread id (none where /proc is absent)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    found = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _LOOP_THREAD:
                    found.add(int(tid))
        except OSError:
            continue  # the thread ended meanwhile
    return found
