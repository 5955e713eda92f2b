"""Which way CGX_COMPRESSION_AUTO sends each call, and what each way cost, over an
emulated link: calls of a few sizes interleaved, a Gloo call of the same size after each.

Per size: the path of every call in order (c: compressed, e: exact), the median time of
each way and of Gloo (slowest rank's), and the class's agreed estimates at the end
(`cgx.stats(group)["auto"]`). Needs root for the emulated rates (benchmarks/netemu.py).

    python -P benchmarks/auto_paths.py                       # 10gbit, 80 calls a size
    python -P benchmarks/auto_paths.py --rate unshaped --calls 200 --values 16384 1048576
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import cgx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from allreduce import _auto_calls  # noqa: E402
from launch import join_worker, run_worker  # noqa: E402

WAYS = ("compressed", "exact", "gloo")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="10gbit", help="link rate (10gbit, 1gbit, unshaped, loopback)")
    parser.add_argument("--calls", type=int, default=80, help="calls of each size")
    parser.add_argument("--values", type=int, nargs="+", default=[16384, 65536, 262144],
                        help="float32 values per call, one size class each")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    return parser.parse_args(argv)


def _timed(x, group):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(x, group=group)
    return time.perf_counter() - start


def worker(config_path):
    cfg = join_worker(config_path)
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=cfg["bits"], hostname=cgx.from_env().hostname))
    gloo = dist.new_group(backend="gloo")
    times = {n: {way: [] for way in WAYS} for n in cfg["values"]}
    paths = {n: "" for n in cfg["values"]}
    for _ in range(cfg["calls"]):
        for n in cfg["values"]:
            exact_before = _auto_calls("cgx", group, n)["exact"]
            took = _timed(torch.randn(n), group)
            way = "exact" if _auto_calls("cgx", group, n)["exact"] > exact_before else "compressed"
            times[n][way].append(took)
            paths[n] += way[0]
            times[n]["gloo"].append(_timed(torch.randn(n), gloo))
    medians = torch.tensor([[statistics.median(times[n][w]) if times[n][w] else 0.0 for w in WAYS]
                            for n in cfg["values"]], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        rows = [{"values": n, "paths": paths[n], **{f"{w}_ms": medians[i][j].item() * 1e3 for j, w in enumerate(WAYS)},
                 "calls": {w: len(times[n][w]) for w in WAYS}} for i, n in enumerate(cfg["values"])]
        with open(cfg["out"], "w") as f:
            json.dump({"rows": rows, "auto": cgx.stats(group)["auto"]}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    cfg = {"calls": args.calls, "values": args.values, "bits": args.bits}
    out = run_worker(__file__, cfg, args.world_size, args.rate, timeout_s=1800)
    for row in out["rows"]:
        print(f"{row['values']} values: compressed {row['compressed_ms']:.2f} ms ({row['calls']['compressed']} calls), "
              f"exact {row['exact_ms']:.2f} ms ({row['calls']['exact']}), Gloo {row['gloo_ms']:.2f} ms")
        print(f"  {row['paths']}")
    for entry in out["auto"]:
        print(entry)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
