"""The Gloo group under a cgx group: its device thread is SCHED_BATCH, and no other is."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import cgx
from cgx.gloo_group import loop_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling")


def test_only_the_cgx_groups_gloo_threads_are_batch_scheduled():
    timeout = datetime.timedelta(seconds=10)
    plain = dist.ProcessGroupGloo(dist.PrefixStore("plain/", dist.HashStore()), 0, 1, timeout)
    plain_threads = loop_threads()
    assert plain_threads, "Gloo names its device thread gloo_tcp_loop; the name changed?"
    backend = cgx.backend.new_backend(dist.HashStore(), 0, 1, timeout, cgx.Config(bits=4))
    ours = loop_threads() - plain_threads
    assert ours
    assert {os.sched_getscheduler(t) for t in ours} == {os.SCHED_BATCH}
    assert {os.sched_getscheduler(t) for t in plain_threads} == {os.SCHED_OTHER}
    t = torch.arange(4096, dtype=torch.float32)
    backend.allreduce([t]).wait()
    assert torch.equal(t, torch.arange(4096, dtype=torch.float32))
    del backend, plain
