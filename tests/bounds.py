"""The quantizer's error bound, written down once for the tests.

A max-min quantizer with b bits maps a bucket with range R = max - min onto
L = 2^b - 1 levels of step R / L. Round-to-nearest is off by at most half a step,
stochastic rounding by less than one step.

A compressed allreduce quantizes in stages. We bound every bucket's range by
per-tensor ranges: a partial sum over any set of ranks has range <= S = sum_r R_r, and
a noisy partial sum with error <= E has range <= S + 2E.
  SRA : stage 1 quantizes each peer's contribution: E1 <= S / (2L);
        stage 2 quantizes the noisy full sum:       E  <= E1 + (R_sum + 2 E1) / (2L).
  Ring: size - 1 hops each re-quantize a noisy partial sum:
        E_k <= E_{k-1} + (S + 2 E_{k-1}) / (2L),
        then the owner quantizes the full sum:   E <= E_{n-1} + (R_sum + 2 E_{n-1}) / (2L).
(Stochastic rounding: replace 2L by L.) Float32 arithmetic adds a few ulps of the
magnitudes involved; float16 / bfloat16 outputs add half an ulp of the result.
"""

from __future__ import annotations

import torch

_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def allreduce_error_bound(
    inputs: list[torch.Tensor],
    bits: int,
    *,
    algorithm: str = "SRA",
    stochastic: bool = False,
    average: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> float:
    """Max absolute error allowed for a compressed allreduce of `inputs` (one per rank)."""
    world = len(inputs)
    xs = [x.double().reshape(-1) for x in inputs]
    exact = torch.stack(xs).sum(0)
    levels = 2**bits - 1
    per_stage = levels if stochastic else 2 * levels
    s = sum(float(x.max() - x.min()) for x in xs)
    r_sum = float(exact.max() - exact.min())
    err = 0.0
    for _ in range(1 if algorithm == "SRA" else world - 1):
        err += (s + 2 * err) / per_stage
    err += (r_sum + 2 * err) / per_stage
    magnitude = sum(float(x.abs().max()) for x in xs)
    err += 64 * 2.0**-24 * magnitude  # float32 decode / add roundings
    if average:
        err /= world
        magnitude /= world
    return err + _UNIT_ROUNDOFF[out_dtype] * (magnitude + err)
