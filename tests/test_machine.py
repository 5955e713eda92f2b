"""What ranks tell each other of their machine at group creation: the warning where the
ranks of one machine ask for more intra-op threads than it has CPUs (torch's OpenMP
threads spin-wait, and oversubscribed they make steps several times slower)."""

from __future__ import annotations

import os
import warnings

import torch

from cgx.machine import RankMachine, oversubscription
from harness import init_cgx, run_ranks, values


def machine(kernel="boot-a", cpus=(0, 1), threads=2, gpu=""):
    return RankMachine(gpu, kernel, cpus, threads)


def test_ranks_of_one_machine_with_more_threads_than_cpus_are_warned_once_by_its_first_rank():
    ranks = [machine(), machine()]
    message = oversubscription(ranks, 0)
    assert "2 ranks" in message and "2 CPUs" in message and "4 intra-op threads" in message, message
    assert "torch.set_num_threads(1)" in message and "OMP_NUM_THREADS=1" in message, message
    assert oversubscription(ranks, 1) is None  # one warning a machine


def test_threads_that_fit_the_cpus_are_not_warned():
    assert oversubscription([machine(threads=1), machine(threads=1)], 0) is None
    # More ranks than CPUs, one thread each: they take turns, none spins waiting for another.
    assert oversubscription([machine(threads=1)] * 4, 0) is None
    assert "5 intra-op threads" in oversubscription([machine(threads=2)] + [machine(threads=1)] * 3, 0)
    assert oversubscription([machine(threads=2)], 0) is None  # a rank alone: torch's own default
    # Pinned to CPUs of their own, each with a thread per CPU.
    assert oversubscription([machine(cpus=(0, 1), threads=2), machine(cpus=(2, 3), threads=2)], 0) is None


def test_machines_are_told_apart_by_their_kernel_not_by_their_host_name():
    # Ranks on machines of their own each have the CPUs to themselves...
    assert oversubscription([machine("boot-a"), machine("boot-b")], 0) is None
    # ...while emulated hosts (network namespaces, CGX_HOSTNAME) share one kernel's CPUs;
    # a machine's first rank warns, whatever its place in the group.
    ranks = [machine("boot-b", threads=1), machine("boot-a"), machine("boot-a", threads=1)]
    assert oversubscription(ranks, 0) is None
    assert "3 intra-op threads" in oversubscription(ranks, 1)
    assert oversubscription(ranks, 2) is None


def test_rank_machine_round_trips_through_the_store_text():
    mine = RankMachine.this_rank()
    assert RankMachine.from_json(mine.to_json()) == mine
    assert mine.cpus == tuple(sorted(os.sched_getaffinity(0))) and mine.threads == torch.get_num_threads()


def _warnings_at_init(rank, world, threads):
    torch.set_num_threads(threads)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        init_cgx(rank, world)
    return [str(w.message) for w in seen if "intra-op threads" in str(w.message)]


def test_init_warns_on_the_first_rank_where_the_ranks_oversubscribe_the_machine():
    cpus = len(os.sched_getaffinity(0))
    seen = values(run_ranks(_warnings_at_init, 2, args=(cpus,)))  # 2 x cpus threads on cpus CPUs
    assert len(seen[0]) == 1 and seen[1] == [], seen
    assert f"{2 * cpus} intra-op threads" in seen[0][0] and f"{cpus} CPUs" in seen[0][0], seen
    # One thread each (the suite's OMP_NUM_THREADS=1, torchrun's): never warned.
    assert values(run_ranks(_warnings_at_init, 2, args=(1,))) == [[], []]
