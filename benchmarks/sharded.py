"""FSDP2's collectives over emulated links: all-gather and reduce-scatter, Gloo and cgx.

One run measures every method side by side, interleaved within each repeat, for each
size (of the full, unsharded buffer), world size and link rate:

- `gloo`: torch's Gloo all_gather_into_tensor / reduce_scatter_tensor (float32, AVG);
- `cgx-<bits>`: ProcessGroupCGX.allgather_layout / reduce_scatter_layout (what cgx.qsdp
  calls), the whole shard one layer quantized at <bits> in buckets of 512.

Every rank runs on its own emulated host (benchmarks/netemu.py; needs root) unless the
rate is `loopback`. Prints a table (median time of the slowest rank, speed-up over Gloo)
and writes JSON (by default under benchmarks/results/, git-ignored).

    python -P benchmarks/sharded.py --sizes-mib 64 --world-sizes 2 4 --rates 1gbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import cgx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import join_worker, run_worker  # noqa: E402
from outputs import default_output, parent_made  # noqa: E402

KINDS = ("allgather", "reduce_scatter")
BUCKET_SIZE = 512


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[64])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["1gbit"])
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", type=parent_made, default=default_output("sharded.json"))
    return parser.parse_args()


def _call(kind, method, backend, full, shard, plan):
    if method == "gloo":
        if kind == "allgather":
            dist.all_gather_into_tensor(full, shard)
        else:
            dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
    elif kind == "allgather":
        backend.allgather_layout(full, shard, plan, stochastic=True, seed=1).wait()
    else:
        backend.reduce_scatter_layout(shard, full, plan, op="avg").wait()


def worker(config_path):
    cfg = join_worker(config_path)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = dataclasses.replace(cgx.from_env(), minimal_size=0)
    backend = cgx.get_backend(dist.new_group(backend="cgx", pg_options=config))
    methods = ["gloo"] + [f"cgx-{b}" for b in cfg["bits"]]
    samples = {}
    for size_mib in cfg["sizes_mib"]:
        shard_numel = int(size_mib * 2**20) // 4 // world
        source = torch.randn(shard_numel * world, generator=torch.Generator().manual_seed(rank))
        full, shard = torch.empty_like(source), torch.empty(shard_numel)
        for repeat in range(-1, cfg["repeats"]):  # -1: warm-up
            for kind in KINDS:
                for method in methods:
                    plan = [] if method == "gloo" else [(0, shard_numel, int(method[4:]), BUCKET_SIZE)]
                    full.copy_(source)
                    shard.copy_(source[:shard_numel])
                    dist.barrier()
                    start = time.perf_counter()
                    _call(kind, method, backend, full, shard, plan)
                    elapsed = time.perf_counter() - start
                    if repeat >= 0:
                        samples.setdefault((size_mib, kind, method), []).append(elapsed)
    keys = sorted(samples)
    times = torch.tensor([samples[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each sample: the slowest rank
    if rank == 0:
        rows = [{"size_mib": s, "kind": k, "method": m, "seconds": times[i].tolist(),
                 "median_s": statistics.median(times[i].tolist())} for i, (s, k, m) in enumerate(keys)]
        with open(cfg["out"], "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    args = parse_args()
    results = []
    for world in args.world_sizes:
        for rate in args.rates:
            print(f"[world {world}, {rate}]", flush=True)
            cfg = {"sizes_mib": args.sizes_mib, "bits": args.bits, "repeats": args.repeats}
            rows = run_worker(__file__, cfg, world, rate, timeout_s=args.timeout_s)
            results += [dict(r, world_size=world, rate=rate) for r in rows]
    print(f"\nmedian of {args.repeats}, slowest rank, {os.cpu_count()} cores, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, bucket {BUCKET_SIZE}")
    print("| collective | ranks | link | MiB | method | median ms | x Gloo |")
    print("|---|---:|---|---:|---|---:|---:|")
    gloo = {(r["kind"], r["world_size"], r["rate"], r["size_mib"]): r["median_s"]
            for r in results if r["method"] == "gloo"}
    for r in results:
        base = gloo[(r["kind"], r["world_size"], r["rate"], r["size_mib"])]
        print(f"| {r['kind']} | {r['world_size']} | {r['rate']} | {r['size_mib']:g} | {r['method']} | "
              f"{1000 * r['median_s']:.0f} | {base / r['median_s']:.2f} |")
    with open(args.json, "w") as f:
        json.dump({"machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                               "platform": platform.platform()},
                   "args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
