"""Throughput of the codec (CPU threads, or a GPU), beside a copy of the same buffer.

Measures cgx.compress and cgx.decompress(..., add=True) in GB/s of float32 input, and
dst.copy_(src) of the same float32 buffer in the same run, so the ratio to memcpy is
comparable across machines. The three operations are timed in turn within each repeat so
that a noisy machine slows them alike; the table shows medians.

    python benchmarks/codec_throughput.py
    python benchmarks/codec_throughput.py --sizes-mib 64 --bits 4 --json codec.json
    python benchmarks/codec_throughput.py --device cuda      # CUDA kernels vs a D2D copy
    python benchmarks/codec_throughput.py --threads 1 2      # the codec on 1, then 2 threads

With several `--threads`, each case is measured at each count in turn (the codec's
`threads=`), and the table adds the speed-up over the first count. The copy stays on one
thread: torch's threads would spin on after it and take cores from the codec.

On the GPU each sample is bracketed by torch.cuda.synchronize(), and "memcpy" is a
device-to-device copy_ of the float32 buffer.
"""

import argparse
import json
import platform
import statistics
import time

import torch

import cgx


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64],
                        help="float32 input sizes in MiB (default: 1 4 16 64)")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8],
                        help="quantization widths (default: 2 4 8)")
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--schemes", nargs="+", default=["maxmin"], choices=["maxmin", "hadamard"],
                        help="quantizer schemes to measure (hadamard: bits 1-4)")
    parser.add_argument("--stochastic", action="store_true",
                        help="time stochastic rounding instead of round-to-nearest")
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed samples per operation; the median is reported")
    parser.add_argument("--min-sample-s", type=float, default=0.02,
                        help="each sample repeats the operation until it lasts about this long")
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="codec threads (cgx.compress(threads=)), one run each (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args()


def calls_per_sample(fn, min_seconds, sync):
    """How many back-to-back calls make one sample of at least min_seconds."""
    fn()  # warm up: page in buffers, load code
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, int(min_seconds / once + 0.5))


def median_seconds_per_call(ops, repeats, min_seconds, sync=lambda: None):
    """Times each op in `ops` (name -> callable) `repeats` times, interleaved; `sync`
    waits for queued device work."""
    calls = {name: calls_per_sample(fn, min_seconds, sync) for name, fn in ops.items()}
    samples = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(numel, bits, scheme, threads, args):
    src = torch.randn(numel, dtype=torch.float32).to(args.device)
    copy_dst = torch.empty_like(src)
    accumulator = torch.zeros_like(src)
    compressed = torch.empty(
        cgx.compressed_size(numel, bits, args.bucket_size, scheme=scheme), dtype=torch.uint8,
        device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def compress():
        cgx.compress(src, bits, args.bucket_size, stochastic=args.stochastic, seed=args.seed,
                     out=compressed, scheme=scheme, threads=threads)

    def decompress_add():
        cgx.decompress(compressed, numel, bits, args.bucket_size, out=accumulator, add=True, scheme=scheme,
                       threads=threads)

    compress()  # decompress_add needs a valid buffer before its first call
    seconds = median_seconds_per_call(
        {"memcpy": lambda: copy_dst.copy_(src), "compress": compress,
         "decompress_add": decompress_add},
        args.repeats, args.min_sample_s, sync)
    input_bytes = numel * src.element_size()
    gbps = {name: input_bytes / s / 1e9 for name, s in seconds.items()}
    return {
        "size_mib": input_bytes / 2**20,
        "bits": bits,
        "scheme": scheme,
        "threads": threads,
        "bucket_size": args.bucket_size,
        "stochastic": args.stochastic,
        "compressed_bytes": compressed.numel(),
        "memcpy_gbps": gbps["memcpy"],
        "compress_gbps": gbps["compress"],
        "decompress_add_gbps": gbps["decompress_add"],
        "compress_vs_memcpy": gbps["compress"] / gbps["memcpy"],
        "decompress_add_vs_memcpy": gbps["decompress_add"] / gbps["memcpy"],
    }


def markdown_table(rows):
    lines = [
        "| size (MiB) | bits | scheme | threads | memcpy GB/s | compress GB/s | x memcpy "
        "| decompress_add GB/s | x memcpy | compress, decompress_add x first count |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = {}
    for r in rows:
        base = first.setdefault((r["size_mib"], r["bits"], r["scheme"]), r)
        lines.append(
            f"| {r['size_mib']:g} | {r['bits']} | {r['scheme']} | {r['threads']} | {r['memcpy_gbps']:.2f} "
            f"| {r['compress_gbps']:.2f} | {r['compress_vs_memcpy']:.2f} "
            f"| {r['decompress_add_gbps']:.2f} | {r['decompress_add_vs_memcpy']:.2f} "
            f"| {r['compress_gbps'] / base['compress_gbps']:.2f}, "
            f"{r['decompress_add_gbps'] / base['decompress_add_gbps']:.2f} |")
    return "\n".join(lines)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rows = []
    for size_mib in args.sizes_mib:
        numel = int(size_mib * 2**20) // 4
        for bits in args.bits:
            for scheme in args.schemes:
                if scheme == "maxmin" or bits <= cgx._C.MAX_HADAMARD_BITS:
                    rows.extend(measure(numel, bits, scheme, t, args) for t in args.threads)
    rounding = "stochastic" if args.stochastic else "round-to-nearest"
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else "threads " + ", ".join(map(str, args.threads)))
    print(f"cgx codec, {where}, bucket {args.bucket_size}, {rounding}, "
          f"median of {args.repeats}; GB/s of float32 input\n")
    print(markdown_table(rows))
    if args.json:
        report = {
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "threads": args.threads,
            "device": args.device,
            "repeats": args.repeats,
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
