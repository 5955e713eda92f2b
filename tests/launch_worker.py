"""One rank of a job started by tests/test_mpi.py or tests/test_launch.py (not a test
module itself).

    mpirun -np N python -P tests/launch_worker.py SCENARIO OUT
    torchrun --standalone --nproc-per-node N tests/launch_worker.py SCENARIO

Every scenario joins with ``dist.init_process_group("cgx")`` and no arguments: the ranks
and the rendezvous come from the launcher (under mpirun through cgx.mpi).

- ``suite``: for each inner / cross communicator, reduction type and host layout that the
  world size allows (hosts told apart by the group's hostname), the core correctness
  checks: lossy float32 / float16 sums within the maxmin quantizer's bound, bit-identical ranks
  (also for a buffer large enough to be pipelined, where hierarchical), exact integer and
  small-tensor sums. Rank 0 writes {case: [failures]} to OUT as JSON.
- ``kill``: compressed allreduces over MPI until rank 1 kills itself (SIGKILL).
- ``dead-peer``: the same, with a group timeout of 4 s; rank 0 prints what it raised and
  after how long (for a launcher that leaves it running), then exits.
- ``plain`` / ``mpi4py-first`` / ``mpi4py-after``: one allreduce over MPI, with mpi4py
  imported before cgx, after it, or not at all, and an MPI collective through mpi4py;
  then MPI is finalised at exit by whoever initialised it. (The groups are destroyed
  first: torch 2.13 itself sometimes aborts at exit with Gloo groups left alive, cgx or
  not.)
- ``gloo``: the same allreduce with the cross communicator Gloo (any launcher).
- ``exit-in-flight``: rank 0 starts an allreduce over MPI that rank 1 never joins and
  exits at once: MPI is finalised while cgx's worker is inside an MPI wait.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

SCENARIO = sys.argv[1]
if SCENARIO == "mpi4py-first":
    from mpi4py import MPI  # noqa: F401  (initialises MPI before cgx)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cgx  # noqa: E402

if SCENARIO == "mpi4py-after":
    from mpi4py import MPI  # noqa: F401,E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bounds import allreduce_error_bound, flat_stages, hierarchical_stages  # noqa: E402
from mpi_cases import cases  # noqa: E402

N = 30011  # odd: a partial last bucket, chunks of unequal size
TIMEOUT = datetime.timedelta(seconds=60)
# The one-rank-per-host groups': what a survivor waits for a dead peer (tests/test_mpi.py).
GROUP_TIMEOUT = datetime.timedelta(seconds=4)


def inputs(world, seed, dtype=torch.float32):
    return [(torch.randn(N, generator=torch.Generator().manual_seed(seed * 100 + r)) * (r + 1))
            .to(dtype) for r in range(world)]


def check_case(rank, world, per_host, fields, group):
    """Failure messages of this rank (empty: all passed)."""
    failures = []
    hosts = world // per_host
    config = cgx.get_backend(group).settings
    if hosts > 1 and per_host > 1:
        if not cgx.get_backend(group).hierarchical:
            failures.append("the hierarchical path was not taken")
        stages = hierarchical_stages(hosts, per_host, fields.get("inner_reduction", "SRA"),
                                     fields.get("cross_reduction", "SRA"),
                                     intra_compress=fields.get("intra_compress", True))
    else:
        alg = fields.get("inner_reduction" if hosts == 1 else "cross_reduction", "SRA")
        stages = flat_stages(alg, world)
    stochastic = config.stochastic_rounding

    for dtype in (torch.float32, torch.float16):
        xs = inputs(world, 1 if dtype == torch.float32 else 2, dtype)
        t = xs[rank].clone()
        dist.all_reduce(t, group=group)
        exact = torch.stack([x.double() for x in xs]).sum(0)
        bound = allreduce_error_bound(xs, 4, stochastic=stochastic, stages=stages, out_dtype=dtype)
        err = float((t.double() - exact).abs().max())
        if not err <= bound:
            failures.append(f"{dtype}: error {err:.4g} over the bound {bound:.4g}")
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)  # the default group: exact
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            failures.append(f"{dtype}: ranks differ")

    if hosts > 1 and per_host > 1:
        # Large enough for the pipelined pieces of the hierarchical allreduce.
        xs = [x.repeat(80) for x in inputs(world, 4)]
        t = xs[rank].clone()
        dist.all_reduce(t, group=group)
        exact = torch.stack([x.double() for x in xs]).sum(0)
        bound = allreduce_error_bound(xs, 4, stochastic=stochastic, stages=stages)
        err = float((t.double() - exact).abs().max())
        if not err <= bound:
            failures.append(f"pipelined: error {err:.4g} over the bound {bound:.4g}")
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            failures.append("pipelined: ranks differ")

    ints = torch.arange(N, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(ints, group=group)
    if not torch.equal(ints, torch.arange(N, dtype=torch.int64) * (world * (world + 1) // 2)):
        failures.append("int64 sum is not exact")
    small = inputs(world, 3)[rank][:16].clone()
    expected = small.clone()
    dist.all_reduce(small, group=group)
    dist.all_reduce(expected)  # the default group (bits 32): Gloo
    if not torch.equal(small, expected):
        failures.append("a tensor at the minimal size is not Gloo's sum")
    return failures


def suite(out_path):
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, per_host, fields in cases(world):
        try:
            group = dist.new_group(backend="cgx", timeout=TIMEOUT, pg_options=cgx.Config(
                bits=4, bucket_size=512, scheme="maxmin", hostname=f"host{rank // per_host}", **fields))
            failures = check_case(rank, world, per_host, fields, group)
            dist.destroy_process_group(group)
        except Exception as e:  # reported per case; the job goes on
            failures = [f"{type(e).__name__}: {e}"]
        gathered = [None] * world
        dist.all_gather_object(gathered, failures)
        results[name] = [f"rank {r}: {m}" for r, fs in enumerate(gathered) for m in fs]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def one_rank_per_host_group(rank, cross="MPI"):
    # maxmin: a constant input comes back exact, so the printed sums are checked as such.
    return dist.new_group(backend="cgx", timeout=GROUP_TIMEOUT,
                          pg_options=cgx.Config(bits=4, scheme="maxmin", hostname=f"host{rank}",
                                                cross_communicator=cross))


def kill():
    rank = dist.get_rank()
    group = one_rank_per_host_group(rank)
    t = torch.randn(1 << 20)
    start = time.monotonic()
    try:
        for step in range(1000):
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t, group=group)
            t /= dist.get_world_size()
    except Exception as e:
        print(f"rank {rank} raised after {time.monotonic() - start:.1f} s: "
              f"{type(e).__name__}: {e}", flush=True)
        os._exit(3)


def with_mpi4py_or_not():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = one_rank_per_host_group(rank, "GLOO" if SCENARIO == "gloo" else "MPI")
    t = torch.full((10000,), float(rank + 1))
    dist.all_reduce(t, group=group)
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)  # the default group: exact
    assert all(torch.equal(g, t) for g in gathered), "ranks' values differ"
    if SCENARIO.startswith("mpi4py"):
        from mpi4py import MPI

        assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
        assert MPI.COMM_WORLD.allreduce(rank) == world * (world - 1) // 2
    print(f"rank {rank} ok: {float(t[0])}", flush=True)
    dist.destroy_process_group()


def exit_in_flight():
    rank = dist.get_rank()
    group = one_rank_per_host_group(rank)
    t = torch.randn(1 << 22)
    if rank == 0:
        dist.all_reduce(t, group=group, async_op=True)
        time.sleep(0.5)  # the worker is polling MPI by now
    else:
        time.sleep(3)
    print(f"rank {rank} ok: exiting", flush=True)


def main():
    dist.init_process_group("cgx", timeout=TIMEOUT)
    if SCENARIO == "suite":
        suite(sys.argv[2])
        dist.destroy_process_group()
    elif SCENARIO in ("kill", "dead-peer"):
        kill()
    elif SCENARIO == "exit-in-flight":
        exit_in_flight()
    else:
        with_mpi4py_or_not()


if __name__ == "__main__":
    main()
