"""Allreduce over emulated commodity links: Gloo float32, Gloo with an fp16 cast, and cgx.

One run measures every method side by side, interleaved within each repeat (so that a
noisy machine slows them alike), for each size, world size and link rate:

- `gloo`: torch's Gloo allreduce of the float32 tensor, on a Gloo group of its own (each
  method has its own group; the barrier before each sample runs on the default one);
- `gloo-fp16`: cast to float16, Gloo allreduce, cast back (the casts are timed);
- `cgx-<bits>-<SRA|Ring>`: the cgx backend, compressed where CGX_COMPRESSION_AUTO finds it
  pays (the table counts the timed calls it sent the exact way; CGX_COMPRESSION_AUTO=0
  compresses every call; the default 12 untimed calls of each size let it settle first);
  with several ranks per host
  (`--ranks-per-host`) this is the hierarchical allreduce (shared memory inside a host,
  the algorithm across hosts), `-leader` its leader form (CGX_INTRA_BROADCAST), and
  `-flat` the same algorithm over all ranks with the topology ignored (every rank its own
  host).

Link rates: `loopback` (all ranks on this host: cgx over shared memory, Gloo over TCP on
lo), `unshaped`, `10gbit`, `1gbit`, ... (one emulated host per rank, network namespaces
joined by veth links shaped with tbf; benchmarks/netemu.py). Needs root for the
emulated rates. Prints a table (median time, and each method's speed-up over Gloo),
writes JSON and a PNG plot (by default under benchmarks/results/, git-ignored).

    python -P benchmarks/allreduce.py                                  # the full matrix
    python -P benchmarks/allreduce.py --sizes-mib 64 --world-sizes 2 --rates 1gbit
    python -P benchmarks/allreduce.py --device cuda --rates loopback   # GPU tensors

With `--device cuda` the tensors are on GPU `local rank % GPU count` (several ranks may
share one), and each timed sample is bracketed by `torch.cuda.synchronize()`.
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
from netemu import link_counters  # noqa: E402
from outputs import default_output, parent_made  # noqa: E402
from plotting import pyplot  # noqa: E402

CGX_METHODS = [f"cgx-{bits}-{alg}" for alg in ("SRA", "Ring") for bits in (8, 4, 2)]
TOPOLOGY_METHODS = [f"cgx-{bits}-{alg}-{form}" for form in ("flat", "leader")
                    for alg in ("SRA", "Ring") for bits in (8, 4, 2)]
METHODS = ["gloo", "gloo-fp16", *CGX_METHODS]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256],
                        help="float32 tensor sizes in MiB (default: 1 4 16 64 256)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["loopback", "10gbit", "1gbit"],
                        help="loopback, unshaped, or a tbf rate such as 10gbit / 1gbit")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks in each emulated host (default 1: every rank its own host)")
    parser.add_argument("--methods", nargs="+", choices=METHODS + TOPOLOGY_METHODS,
                        default=METHODS)
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per method")
    parser.add_argument("--warmup", type=int, default=12,
                        help="untimed calls per size and method first (default 12: CGX_COMPRESSION_AUTO "
                             "times 3 calls each way, then settles from the 7th, and re-tries the "
                             "slower way 64 calls later, so the timed calls measure its steady state; "
                             "1 measures its trials)")
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the tensors are (default cpu)")
    parser.add_argument("--json", metavar="PATH", type=parent_made, default=default_output("allreduce.json"))
    parser.add_argument("--plot", metavar="PATH", type=parent_made, default=default_output("allreduce.png"))
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per (world size, rate) job")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------
# One rank (run by launch.run_job with torch's env:// variables)


def _groups(methods, bucket_size):
    env_config = cgx.from_env()  # CGX_HOSTNAME tells emulated hosts apart
    groups = {}
    for method in methods:
        if method.startswith("gloo"):
            # A group of its own, like each cgx method: the barrier before each sample runs
            # on WORLD, and a group whose connections just carried it would start warm.
            groups[method] = dist.new_group(backend="gloo")
        else:
            _, bits, algorithm, *form = method.split("-")
            config = dataclasses.replace(env_config, bits=int(bits), bucket_size=bucket_size,
                                         inner_reduction=algorithm, cross_reduction=algorithm,
                                         minimal_size=0, intra_broadcast=form == ["leader"])
            if form == ["flat"]:
                config = dataclasses.replace(config, hostname=f"rank-{dist.get_rank()}")
            groups[method] = dist.new_group(backend="cgx", pg_options=config)
    return groups


def _bytes_sent(emulated, method, group):
    """(bytes this host sent on its link and TCP segments it retransmitted: counted by the
    host's first rank only, None on the others and on loopback where there is no link;
    payload bytes cgx counted on `group` and the part of them that went to other hosts, 0
    for the Gloo methods)."""
    wire = retransmitted = None
    if emulated and os.environ.get("LOCAL_RANK", "0") == "0":
        wire, retransmitted = link_counters()
    if not method.startswith("cgx"):
        return wire, retransmitted, 0, 0
    stats = cgx.stats(group)
    return wire, retransmitted, stats["bytes_sent"], stats["cross_host_bytes"]


def _auto_calls(method, group, numel):
    """CGX_COMPRESSION_AUTO's calls so far, per path, in the size class of `numel` float32
    values (zeros for Gloo and with auto off)."""
    calls = {"compressed": 0, "exact": 0}
    if not method.startswith("cgx"):
        return calls
    min_bytes = 1 << (4 * numel).bit_length() - 1
    for entry in cgx.stats(group)["auto"]:
        if entry["min_bytes"] == min_bytes:
            calls = {"compressed": entry["compressed_calls"], "exact": entry["exact_calls"]}
    return calls


def _allreduce(method, group, x):
    if method == "gloo-fp16":
        h = x.to(torch.float16)
        dist.all_reduce(h, group=group)
        x.copy_(h)
    else:
        dist.all_reduce(x, group=group)


def worker(config_path):
    cfg = join_worker(config_path)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = _groups(cfg["methods"], cfg["bucket_size"])
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples = {}  # (size, method) -> [seconds per repeat on this rank]
    wire = {}  # (size, method) -> [bytes this host sent, payload cgx counted]
    paths = {}  # (size, method) -> CGX_COMPRESSION_AUTO's timed calls {"compressed": n, "exact": m}
    for size_mib in cfg["sizes_mib"]:
        n = int(size_mib * 2**20) // 4
        source = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(device)
        x = torch.empty_like(source)
        # Negative repeats warm up; repeat -1 also counts the bytes on the wire.
        for repeat in range(-max(cfg["warmup"], 1), cfg["repeats"]):
            if repeat == 0:
                auto_before = {m: _auto_calls(m, groups[m], n) for m in cfg["methods"]}
            if rank == 0 and repeat >= -1:
                print(f"  {size_mib:g} MiB, repeat {repeat + 1}/{cfg['repeats']}", flush=True)
            for method in cfg["methods"]:
                group = groups[method]
                x.copy_(source)
                dist.barrier()
                before = _bytes_sent(cfg["emulated"], method, group)
                synchronize()
                start = time.perf_counter()
                _allreduce(method, group, x)
                synchronize()
                elapsed = time.perf_counter() - start
                if repeat < 0:
                    dist.barrier()  # every peer has received what this host sent
                    after = _bytes_sent(cfg["emulated"], method, group)
                    wire[(size_mib, method)] = [
                        None if b is None else a - b for a, b in zip(after, before)]
                else:
                    samples.setdefault((size_mib, method), []).append(elapsed)
        for m in cfg["methods"]:
            after = _auto_calls(m, groups[m], n)
            paths[(size_mib, m)] = {p: after[p] - auto_before[m][p] for p in after}
    # Each sample's time is the slowest rank's; wire bytes are gathered per rank.
    keys = sorted(samples)
    times = torch.tensor([samples[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    gathered = [None] * world
    dist.all_gather_object(gathered, [wire[k] for k in keys])
    if rank == 0:
        rows = []
        for i, (size_mib, method) in enumerate(keys):
            per_rank = [g[i] for g in gathered]
            rows.append({"size_mib": size_mib, "method": method, "seconds": times[i].tolist(),
                         "median_s": statistics.median(times[i].tolist()),
                         "wire_bytes": [w[0] for w in per_rank],
                         "retransmitted_segments": [w[1] for w in per_rank],
                         "payload_bytes": [w[2] for w in per_rank],
                         "auto_calls": paths[(size_mib, method)],
                         "cross_host_payload_bytes": [w[3] for w in per_rank]})
        with open(cfg["out"], "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# The driver


def run_matrix(args):
    results = []
    for world in args.world_sizes:
        for rate in args.rates:
            print(f"[world {world}, {rate}]", flush=True)
            cfg = {"methods": args.methods, "sizes_mib": args.sizes_mib, "repeats": args.repeats,
                   "warmup": args.warmup,
                   "bucket_size": args.bucket_size, "device": args.device,
                   "emulated": rate != "loopback"}
            for row in run_worker(__file__, cfg, world, rate, ranks_per_host=args.ranks_per_host,
                                  timeout_s=args.timeout_s):
                results.append(dict(row, world_size=world, rate=rate, ranks_per_host=args.ranks_per_host))
    return results


def table(results) -> str:
    """Markdown: median ms per method, its speed-up over Gloo float32, and how many of its
    timed calls CGX_COMPRESSION_AUTO sent the exact way."""
    lines = []
    methods = [m for m in METHODS + TOPOLOGY_METHODS if any(r["method"] == m for r in results)]
    by_key = {(r["world_size"], r["rate"], r["size_mib"], r["method"]): r for r in results}
    cases = sorted({(r["world_size"], r["rate"], r["size_mib"]) for r in results},
                   key=lambda c: (c[0], c[1], c[2]))
    lines.append("| ranks | link | MiB | " + " | ".join(methods) + " |")
    lines.append("|---:|---|---:|" + "---:|" * len(methods))
    for world, rate, size in cases:
        gloo = by_key.get((world, rate, size, "gloo"))
        cells = []
        for m in methods:
            r = by_key.get((world, rate, size, m))
            if r is None:
                cells.append("")
                continue
            ms = r["median_s"] * 1e3
            exact = r.get("auto_calls", {}).get("exact", 0)
            cells.append(f"{ms:.1f}" + (f" ({gloo['median_s'] / r['median_s']:.2f}x)"
                                        if gloo and m != "gloo" else "")
                         + (f" [{exact} exact]" if exact else ""))
        lines.append(f"| {world} | {rate} | {size:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def link_bytes(row) -> int:
    """Bytes that crossed the links, all hosts together."""
    return sum(w for w in row["wire_bytes"] if w is not None)


def wire_table(results) -> str:
    """Bytes that crossed the links (all hosts, headers included) against Gloo's."""
    rows = [r for r in results if r["wire_bytes"][0] is not None]
    if not rows:
        return ""
    by_key = {(r["world_size"], r["rate"], r["size_mib"], r["method"]): r for r in rows}
    lines = ["| ranks | link | MiB | method | MiB on the wire | payload MiB (cgx) | x fewer than gloo |",
             "|---:|---|---:|---|---:|---:|---:|"]
    for r in rows:
        wire = link_bytes(r)
        gloo = by_key.get((r["world_size"], r["rate"], r["size_mib"], "gloo"))
        ratio = f"{link_bytes(gloo) / wire:.2f}" if gloo else ""
        payload = f"{sum(r['payload_bytes']) / 2**20:.2f}" if r["method"].startswith("cgx") else ""
        lines.append(f"| {r['world_size']} | {r['rate']} | {r['size_mib']:g} | {r['method']} | "
                     f"{wire / 2**20:.2f} | {payload} | {ratio} |")
    return "\n".join(lines)


def plot(results, path) -> bool:
    """Draws the results into `path`; False where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    worlds = sorted({r["world_size"] for r in results})
    rates = list(dict.fromkeys(r["rate"] for r in results))
    fig, axes = plt.subplots(len(worlds), len(rates), figsize=(5 * len(rates), 4 * len(worlds)),
                             squeeze=False)
    for i, world in enumerate(worlds):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for method in METHODS + TOPOLOGY_METHODS:
                pts = sorted((r["size_mib"], r["median_s"] * 1e3) for r in results
                             if r["world_size"] == world and r["rate"] == rate and r["method"] == method)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=method,
                            linestyle="--" if method.startswith("gloo") else "-")
            ax.set(xscale="log", yscale="log", xlabel="tensor size (MiB, float32)",
                   ylabel="allreduce time (ms)", title=f"{world} ranks, {rate}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    args = parse_args()
    started = time.time()
    results = run_matrix(args)
    auto = "on" if cgx.from_env().compression_auto else "off"
    print(f"\nallreduce of {args.device} tensors, median of {args.repeats} after {args.warmup} warm-up, "
          f"CGX_COMPRESSION_AUTO {auto}, {os.cpu_count()} cores, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"bucket {args.bucket_size}, {args.ranks_per_host} rank(s) per host, "
          f"{time.time() - started:.0f} s")
    print(table(results))
    if any(r.get("auto_calls", {}).get("exact") for r in results):
        print("[n exact]: n of the timed calls went the exact way, where CGX_COMPRESSION_AUTO timed it faster "
              "on this machine (the figure is then not compression's); CGX_COMPRESSION_AUTO=0 compresses every call")
    wire = wire_table(results)
    if wire:
        print("\n" + wire)
    with open(args.json, "w") as f:
        json.dump({"machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                               "platform": platform.platform()},
                   "args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {args.json}" + (f" and {args.plot}" if plot(results, args.plot) else ""))


if __name__ == "__main__":
    main()
