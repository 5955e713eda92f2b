"""Soak: many compressed allreduces on one group, then groups created and destroyed.

Two ranks (processes on this machine, shared memory between them). Phase 1: 10,000
compressed allreduces of mixed sizes on one cgx group. Phase 2: 50 times, create a cgx
group, run a few allreduces on it, destroy it. Prints each rank's resident memory
(VmRSS) and thread count at checkpoints, and what is left in /dev/shm. Resident memory
should stay flat once warm; threads and /dev/shm entries should return to where they
started.

    python -P benchmarks/soak.py [--calls 10000] [--groups 50] [--json soak.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (1, 17, 1000, 65_536, 1_000_000)  # exact and compressed, one bucket to many


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def shm_entries() -> int:
    return sum(name.startswith("cgx-") for name in os.listdir("/dev/shm"))


def rank_main(rank: int, world: int, calls: int, groups: int, store: str, out: str) -> None:
    import cgx

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    tensors = {n: torch.randn(n) for n in SIZES}
    rows = []

    def checkpoint(phase, done):
        time.sleep(3)  # cgx's callback threads end after 2 s idle
        rows.append({"phase": phase, "done": done, "rss_mib": round(rss_mib(), 1),
                     "threads": threads(), "shm": shm_entries()})

    dist.barrier()  # Gloo starts its own threads for the default group on its first use
    checkpoint("start", 0)
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, minimal_size=16))
    for i in range(calls):
        t = tensors[SIZES[i % len(SIZES)]].clone()
        dist.all_reduce(t, group=group)
        if (i + 1) in (100, calls // 4, calls // 2, 3 * calls // 4, calls):
            checkpoint("allreduces", i + 1)
    dist.destroy_process_group(group)
    checkpoint("group destroyed", calls)
    for g in range(groups):
        group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, minimal_size=16))
        for n in SIZES:
            dist.all_reduce(tensors[n].clone(), group=group)
        dist.destroy_process_group(group)
        if (g + 1) in (1, groups // 4, groups // 2, 3 * groups // 4, groups):
            checkpoint("groups created and destroyed", g + 1)
    dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--json", help="write the checkpoints here")
    args = parser.parse_args()
    world = 2
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(rank_main, args=(world, args.calls, args.groups, os.path.join(tmp, "store"), out),
                 nprocs=world)
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(world)]
    print(f"soak: {world} ranks, {args.calls} allreduces of sizes {SIZES}, then {args.groups} "
          f"groups created and destroyed; torch {torch.__version__}, {os.cpu_count()} cores, "
          f"{time.time() - started:.0f} s")
    print("| phase | done | " + " | ".join(f"rank {r} RSS MiB | rank {r} threads" for r in range(world))
          + " | cgx-* in /dev/shm |")
    print("|---|---:|" + "---:|---:|" * world + "---:|")
    for rows in zip(*per_rank):
        cells = " | ".join(f"{r['rss_mib']} | {r['threads']}" for r in rows)
        print(f"| {rows[0]['phase']} | {rows[0]['done']} | {cells} | {rows[0]['shm']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": args.calls, "groups": args.groups, "ranks": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
