"""How each quantizer distorts real gradients over the two stages of a 2-rank SRA allreduce.

Trains the GPT task of train.py in one process (the mean of two ranks' batches, AdamW,
exact), and at the probe steps takes both ranks' gradients g0, g1 of every parameter and
quantizes them as the cgx hook's allreduce does without error feedback: stage 1 sums
Q(g0) + Q(g1) (every contribution quantized, as SRA's owner does), stage 2 re-quantizes
that sum (the all-gather). Against the exact sum g = g0 + g1, over the whole model:

  error    |Q - g|^2 / |g|^2           the noise the quantizer adds
  scale    <Q, g> / |g|^2              1 for an unbiased quantizer; below 1: it shrinks g

Tensors of 16 values or fewer stay exact, as under the hook's default minimal size.

    python benchmarks/gradient_distortion.py --gpt-dim 288
    python benchmarks/gradient_distortion.py --bits 2 3 --probe-at 1 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import cgx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here
from outputs import default_output, parent_made  # noqa: E402
from train import GPTTask  # noqa: E402

SCHEMES = (("maxmin", False), ("maxmin", True), ("hadamard", False), ("hadamard", True))
MINIMAL_SIZE = 16


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-dim", type=int, default=288)
    parser.add_argument("--bits", type=int, nargs="+", default=[2])
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--probe-at", type=int, nargs="+", default=[1, 50, 200],
                        help="training steps after which to probe (default: 1 50 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=default_output("gradient_distortion.json"))
    return parser.parse_args()


def quantized(x: torch.Tensor, bits: int, bucket: int, scheme: str, stochastic: bool, seed: int) -> torch.Tensor:
    flat = x.detach().flatten().float().contiguous()
    if flat.numel() <= MINIMAL_SIZE:
        return x.clone()
    wire = cgx.compress(flat, bits, bucket, scheme=scheme, stochastic=stochastic, seed=seed)
    return cgx.decompress(wire, flat.numel(), bits, bucket, scheme=scheme).view_as(x)


def distortion(g0, g1, bits, bucket, scheme, stochastic) -> dict:
    sums = {"norm": 0.0, "error1": 0.0, "error2": 0.0, "dot1": 0.0, "dot2": 0.0}
    for i, (a, b) in enumerate(zip(g0, g1)):
        exact = a + b
        seed = 3 * i  # a stream per contribution and stage
        stage1 = (quantized(a, bits, bucket, scheme, stochastic, seed)
                  + quantized(b, bits, bucket, scheme, stochastic, seed + 1))
        stage2 = quantized(stage1, bits, bucket, scheme, stochastic, seed + 2)
        sums["norm"] += float(exact.pow(2).sum())
        for k, q in (("1", stage1), ("2", stage2)):
            sums["error" + k] += float((q - exact).pow(2).sum())
            sums["dot" + k] += float((q * exact).sum())
    norm = sums.pop("norm")
    return {"error_stage1": sums["error1"] / norm, "error_stage2": sums["error2"] / norm,
            "scale_stage1": sums["dot1"] / norm, "scale_stage2": sums["dot2"] / norm}


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    task = GPTTask(dim=args.gpt_dim)
    model = task.model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=task.lr)

    def gradients(rank, step):
        model.zero_grad()
        task.loss(model, *task.batch_for(rank, step, seed=args.seed)).backward()
        return [p.grad.detach().clone() for p in params]

    rows = []
    print(f"GPT dim {args.gpt_dim}, buckets of {args.bucket_size}, 2 ranks, no error feedback")
    print("| step | bits | scheme | rounding | error stage 1 | error stage 2 | scale stage 1 | scale stage 2 |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for step in range(1, max(args.probe_at) + 1):
        g0, g1 = gradients(0, step), gradients(1, step)
        for p, a, b in zip(params, g0, g1):
            p.grad = (a + b) / 2
        opt.step()
        if step not in args.probe_at:
            continue
        # The next step's gradients, at the weights training reached.
        g0, g1 = gradients(0, step + 1), gradients(1, step + 1)
        for bits in args.bits:
            for scheme, stochastic in SCHEMES:
                row = {"step": step, "bits": bits, "scheme": scheme,
                       "rounding": "stochastic" if stochastic else "nearest",
                       **distortion(g0, g1, bits, args.bucket_size, scheme, stochastic)}
                rows.append(row)
                print(f"| {step} | {bits} | {scheme} | {row['rounding']} | {row['error_stage1']:.3f} | "
                      f"{row['error_stage2']:.3f} | {row['scale_stage1']:.3f} | {row['scale_stage2']:.3f} |",
                      flush=True)
    with open(parent_made(args.json), "w") as f:
        json.dump({"gpt_dim": args.gpt_dim, "bucket_size": args.bucket_size, "seed": args.seed, "rows": rows}, f,
                  indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
