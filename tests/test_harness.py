"""The test harness itself: forked ranks see what spawned interpreters would see.

Ranks are forked from a server that imported torch and cgx once (tests/harness.py says
what a fork changes); each property here failed before the harness restored it.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from harness import RankError, run_ranks, values


def _what_a_rank_sees(rank, world):
    import random

    import torch
    import torch.distributed as dist

    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool of more than one thread, whatever the suite's OMP_NUM_THREADS
    x = torch.randn(1 << 22)
    parallel_sum = float(x.sum())  # the intra-op pool at work (a pool broken by the fork hangs here)
    product = torch.randn(512, 512) @ torch.randn(512, 512)
    return {
        "probe": os.environ.get("CGX_HARNESS_PROBE"),
        "given": os.environ.get("CGX_HARNESS_GIVEN"),
        "debug_level": str(dist.get_debug_level()),
        "torch_rank": os.environ.get("RANK"),
        "threads": threads,
        "random": random.random(),
        "torch_random": float(torch.rand(1)),
        "worked": parallel_sum == parallel_sum and product.shape == (512, 512),
        "seconds": time.monotonic() - started,
    }


def test_a_rank_sees_the_callers_environment_and_what_is_read_from_it_at_import(monkeypatch):
    run_ranks(_what_a_rank_sees, 1)  # the server is running before the caller's environment changes
    monkeypatch.setenv("CGX_HARNESS_PROBE", "set after the server started")
    env = {"CGX_HARNESS_GIVEN": "given", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
           # An MPI launch's variables, with an address so that adoption needs no MPI call.
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    seen = values(run_ranks(_what_a_rank_sees, 2, env=env))
    spawned_threads = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                         capture_output=True, text=True, check=True).stdout)
    for rank in seen:
        assert rank["probe"] == "set after the server started"
        assert rank["given"] == "given"
        assert rank["debug_level"] == "DebugLevel.DETAIL"  # torch reads it at import
        assert rank["torch_rank"] == "1"  # cgx.mpi adopts an MPI launch at import
        assert rank["threads"] == spawned_threads and rank["worked"]
    assert seen[0]["random"] != seen[1]["random"]  # not the server's state, copied twice
    plain = values(run_ranks(_what_a_rank_sees, 1))[0]
    assert plain["debug_level"] == "DebugLevel.OFF" and plain["torch_rank"] is None
    # torch's default generator is seeded anew in every rank of every call, as when spawned.
    assert len({r["torch_random"] for r in [*seen, plain]}) == 3


def _threads_and_hash(rank, world):
    import torch

    return torch.get_num_threads(), hash("cgx"), os.environ.get("PYTHONHASHSEED")


def test_settings_read_at_start_get_spawned_ranks():
    """A variable the interpreter or torch reads as it starts cannot change in a forked
    rank: such calls spawn their ranks, which see it."""
    # A thread count other than the suite's (tests/conftest.py); torch caps it at the cores,
    # so the count expected is what a fresh interpreter given it reports.
    other = "2" if os.environ.get("OMP_NUM_THREADS") != "2" else "1"
    expected = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                  env=dict(os.environ, OMP_NUM_THREADS=other), capture_output=True, text=True,
                                  check=True).stdout)
    other_threads = values(run_ranks(_threads_and_hash, 2, env={"OMP_NUM_THREADS": other}))
    assert [threads for threads, _, _ in other_threads] == [expected, expected]
    seeded = values(run_ranks(_threads_and_hash, 2, env={"PYTHONHASHSEED": "7"}))
    assert seeded[0][1] == seeded[1][1] and seeded[0][2] == "7"
    spawned = values(run_ranks(_threads_and_hash, 2, spawn=True))
    assert spawned[0][1] != spawned[1][1]  # fresh interpreters: a hash seed each


def _prints(rank, world):
    print(f"rank {rank} says hello", flush=True)
    os.write(2, f"rank {rank} writes to fd 2\n".encode())
    return rank


def test_a_ranks_output_reaches_the_test_that_ran_it(capfd):
    run_ranks(_prints, 2)
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    assert "rank 1 writes to fd 2" in err, err


def _hangs_at_exit(rank, world):
    import atexit

    atexit.register(time.sleep, 600)
    return rank


def _sleeps(rank, world):
    if rank == 1:
        time.sleep(600)


def _raises_while_another_waits(rank, world):
    if rank == 0:
        raise KeyError("rank 0's own error")
    time.sleep(600)


def _raises(rank, world):
    if rank == 1:
        raise KeyError("rank 1's own error")
    return rank


def _exits(rank, world):
    if rank == 0:
        os._exit(3)
    return rank


def test_a_hang_is_killed_at_the_limit_and_errors_and_deaths_are_reported():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 3 s"):
        run_ranks(_sleeps, 2, timeout_s=3)
    with pytest.raises(AssertionError, match=r"(?s)ranks \[1\] still running.*rank 0 raised KeyError.*"
                                             r"rank 1's threads at the limit.*_raises_while_another_waits"):
        run_ranks(_raises_while_another_waits, 2, timeout_s=3)  # why the others waited on
    assert time.monotonic() - started < 30
    assert multiprocessing.active_children() == []
    results = run_ranks(_raises, 2)
    assert results[0] == 0 and isinstance(results[1], RankError) and results[1].type == "KeyError"
    assert "rank 1's own error" in results[1].message and "_raises" in results[1].traceback
    with pytest.raises(AssertionError, match="rank 0 died with exit code 3"):
        run_ranks(_exits, 2)
    assert run_ranks(_exits, 2, expect_exit={0}) == [None, 1]
    with pytest.raises(AssertionError, match="still running after 3 s"):  # as at a spawned rank's exit
        run_ranks(_hangs_at_exit, 1, timeout_s=3)


def _leaves_a_segment(rank, world, tag):
    """Creates /dev/shm/cgx-<tag>-... and leaves it there (a leak, or another suite's)."""
    name = f"cgx-{tag}-harness-{os.getpid()}"
    os.close(os.open(os.path.join("/dev/shm", name), os.O_CREAT | os.O_WRONLY, 0o600))
    return name


def test_the_leak_check_sees_this_suites_segments_and_not_another_suites():
    from harness import SHM_NAME_TAG

    other = values(run_ranks(_leaves_a_segment, 1, args=(f"{SHM_NAME_TAG}other",)))[0]
    try:  # another suite's segment, appearing during the call: not this suite's leak
        assert os.path.exists(os.path.join("/dev/shm", other))
    finally:
        os.unlink(os.path.join("/dev/shm", other))
    leaked = f"cgx-{SHM_NAME_TAG}-harness-"
    try:
        with pytest.raises(AssertionError, match=f"left in /dev/shm: \\['{leaked}"):
            run_ranks(_leaves_a_segment, 1, args=(SHM_NAME_TAG,))
    finally:
        for name in os.listdir("/dev/shm"):
            if name.startswith(leaked):
                os.unlink(os.path.join("/dev/shm", name))
