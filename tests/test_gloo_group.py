"""The Gloo group under a cgx group: the threads its creation starts are SCHED_BATCH, and
no other thread is (not a plain Gloo group's, made before or meanwhile by another thread,
nor the caller's, nor cgx's own)."""

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import cgx
from cgx.gloo_group import new_gloo_group

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling")

TIMEOUT = datetime.timedelta(seconds=30)


def _threads() -> dict[int, bytes]:
    """This process's threads and their names (bytes: a name cut at 15 bytes need not be
    UTF-8)."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                names[int(tid)] = f.read().strip()
        except OSError:
            continue
    return names


def _named(tids: set[int], name: bytes, expected: int) -> set[int]:
    """The threads among `tids` called `name`, once `expected` of them have named
    themselves (Gloo's threads do so after they start)."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while True:
        names = _threads()
        found = {t for t in tids if names.get(t) == name}
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def _loop_threads(tids: set[int], expected: int) -> set[int]:
    return _named(tids, b"gloo_tcp_loop", expected)


def test_the_cgx_groups_gloo_threads_are_batch_and_no_other_thread_is():
    plain = dist.ProcessGroupGloo(dist.PrefixStore("plain/", dist.HashStore()), 0, 1, TIMEOUT)
    before = set(_threads())
    plain_loops = _loop_threads(before, 1)
    backend = cgx.backend.new_backend(dist.HashStore(), 0, 1, TIMEOUT, cgx.Config(bits=4))
    started = set(_threads()) - before
    ours = _loop_threads(started, 1)
    assert plain_loops and ours, "Gloo names its device thread gloo_tcp_loop; the name changed?"
    assert {os.sched_getscheduler(t) for t in ours} == {os.SCHED_BATCH}
    assert {os.sched_getscheduler(t) for t in plain_loops} == {os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own policy is back
    # A Gloo group's own worker threads (2 by default) name themselves after they start too.
    gloo_workers = _named(started, b"pt_gloo_runloop", 2)
    workers = [t for t in started - ours - gloo_workers if t in _threads()]
    assert workers and {os.sched_getscheduler(t) for t in workers} == {os.SCHED_OTHER}  # cgx's threads
    t = torch.arange(4096, dtype=torch.float32)
    backend.allreduce([t]).wait()
    assert torch.equal(t, torch.arange(4096, dtype=torch.float32))
    del backend, plain


def test_a_gloo_group_another_thread_makes_meanwhile_is_left_alone():
    """Rank 0's creation waits for rank 1 (made last, on another thread); a plain Gloo
    group made between them, on this thread, keeps Gloo's default scheduling."""
    store = dist.HashStore()
    groups = {}
    rank0 = threading.Thread(target=lambda: groups.setdefault(0, new_gloo_group(store, 0, 2, TIMEOUT)))
    before = set(_threads())
    rank0.start()
    while not store.num_keys():  # rank 0 has published its address: its threads run
        time.sleep(0.01)
    meanwhile = set(_threads())
    plain = dist.ProcessGroupGloo(dist.PrefixStore("plain/", dist.HashStore()), 0, 1, TIMEOUT)
    plain_loops = _loop_threads(set(_threads()) - meanwhile, 1)
    groups[1] = new_gloo_group(store, 1, 2, TIMEOUT)
    rank0.join()
    ours = _loop_threads(set(_threads()) - before - plain_loops, 2)
    assert len(plain_loops) == 1 and len(ours) == 2
    assert {os.sched_getscheduler(t) for t in plain_loops} == {os.SCHED_OTHER}
    assert {os.sched_getscheduler(t) for t in ours} == {os.SCHED_BATCH}
    t = torch.ones(8)
    works = [groups[r].allreduce([x]) for r, x in ((0, t), (1, torch.ones(8)))]
    for w in works:
        w.wait()
    assert torch.equal(t, torch.full((8,), 2.0))
