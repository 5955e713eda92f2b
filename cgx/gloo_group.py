"""The Gloo process group that carries a cgx group's exact path and its links to other
hosts, with its threads kept from preempting the threads that feed them.

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

import contextlib
import datetime
import os
from typing import Iterator

import torch.distributed as dist

__all__ = ["new_gloo_group"]


def new_gloo_group(store: dist.Store, rank: int, size: int,
                   timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A ProcessGroupGloo on `store` whose threads (Gloo's device thread and the group's
    workers) are scheduled SCHED_BATCH where Linux allows it; elsewhere a plain one."""
    with _threads_started_here_batch():
        return dist.ProcessGroupGloo(store, rank, size, timeout)


@contextlib.contextmanager
def _threads_started_here_batch() -> Iterator[None]:
    """Threads this thread starts meanwhile are SCHED_BATCH: Linux threads take their
    creator's policy, so none started by another thread is touched, and none is found by
    name (Gloo names its device thread after it starts). This thread's own policy is put
    back after; a thread scheduled otherwise than SCHED_OTHER is left alone."""
    if not hasattr(os, "sched_setscheduler"):
        yield
        return
    try:
        switched = os.sched_getscheduler(0) == os.SCHED_OTHER
        if switched:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a seccomp profile that refuses it: the group is Gloo's default
        switched = False
    try:
        yield
    finally:
        if switched:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
