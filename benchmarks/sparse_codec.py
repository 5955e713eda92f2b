"""A sparse sync's own cost against the dense codec's, on one thread: per call, in ms.

For a layer of N float32 values (normal), cgx.DiLoCo's sparse outer gradients (cgx.diloco.
TopK) encode a replica's payload (each chunk's k largest, their places' code, the values
quantized, and the residual: the values minus what the others decode) and add a payload into a sum; with shared
places every replica draws the same places. Beside them, in the same run and interleaved,
cgx's dense codec on the same N values (compress, decompress-add): what a dense 2-bit sync
costs. Medians of the repeats.

    python benchmarks/sparse_codec.py
    python benchmarks/sparse_codec.py --numel 262144 2097152 --k 32 --chunk 1024
"""

import argparse
import os
import platform
import sys

import torch

import cgx
from cgx.diloco.sparse import SparsePlan, TopK

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here

from codec_throughput import median_seconds_per_call  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 18, 1 << 21], help="values of the layer")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--k", type=int, default=TopK.k)
    parser.add_argument("--chunk", type=int, default=TopK.chunk)
    parser.add_argument("--shared-k", type=int, default=256, help="places of each chunk with shared=True")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.node()}, torch {torch.__version__}, one thread; {args.bits} bits, bucket {args.bucket_size}; "
          f"own places {args.k} of {args.chunk}, shared {args.shared_k} of {args.chunk}; ms per call (median)")
    print("| values | own: encode (and residual) | own: add | shared: draw places | dense: compress | dense: decompress-add |")
    print("|---:|---:|---:|---:|---:|---:|")
    for numel in args.numel:
        layer = [(0, numel, args.bits, args.bucket_size, "maxmin")]
        own, shared = SparsePlan(layer, TopK(args.k, args.chunk)), SparsePlan(layer, TopK(args.shared_k, args.chunk,
                                                                                              shared=True))
        values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        payload = own.encode(values)
        dense = cgx.compress(values, args.bits, args.bucket_size)
        into, residual = torch.zeros(numel), torch.empty(numel)
        ms = median_seconds_per_call({
            "encode": lambda: own.encode(values, residual),
            "add": lambda: own.add(payload, into),
            "draw": lambda: shared.shared_places(7, values.device),
            "compress": lambda: cgx.compress(values, args.bits, args.bucket_size),
            "decompress": lambda: cgx.decompress(dense, numel, args.bits, args.bucket_size, out=into, add=True),
        }, args.repeats, 0.05)
        print(f"| {numel:,} | " + " | ".join(f"{1e3 * ms[k]:.2f}" for k in
                                             ("encode", "add", "draw", "compress", "decompress")) + " |")


if __name__ == "__main__":
    main()
