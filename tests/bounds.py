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
  Hierarchical (k ranks per host, H hosts): the inner reduce-scatter quantizes partial
        sums (1 stage with SRA, k-1 with Ring; none without intra compression), the cross
        allreduce adds its own (1 / H-1) partial stages and the final one; its bytes are
        forwarded inside the host without a further stage. Every partial stage is
        bounded like the first, the final one like the last.
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
    stages: tuple[int, int] | None = None,
) -> float:
    """Max absolute error allowed for a compressed allreduce of `inputs` (one per rank).
    `stages` = (partial, final) quantization stages, for the hierarchical forms
    (:func:`hierarchical_stages`); by default those of the flat `algorithm`."""
    world = len(inputs)
    xs = [x.double().reshape(-1) for x in inputs]
    exact = torch.stack(xs).sum(0)
    levels = 2**bits - 1
    per_stage = levels if stochastic else 2 * levels
    s = sum(float(x.max() - x.min()) for x in xs)
    r_sum = float(exact.max() - exact.min())
    partial, final = stages or flat_stages(algorithm, world)
    err = 0.0
    for _ in range(partial):
        err += (s + 2 * err) / per_stage
    for _ in range(final):
        err += (r_sum + 2 * err) / per_stage
    magnitude = sum(float(x.abs().max()) for x in xs)
    err += 64 * 2.0**-24 * magnitude  # float32 decode / add roundings
    if average:
        err /= world
        magnitude /= world
    return err + _UNIT_ROUNDOFF[out_dtype] * (magnitude + err)


def flat_stages(algorithm: str, world: int) -> tuple[int, int]:
    return (1 if algorithm == "SRA" else world - 1), 1


def hierarchical_stages(hosts: int, per_host: int, inner: str, cross: str, *,
                        intra_compress: bool = True) -> tuple[int, int]:
    """(partial, final) stages of the hierarchical allreduce (either form: the leader
    form's reduction to one rank has as many stages as the spread form's)."""
    cross_partial, final = flat_stages(cross, hosts)
    inner_partial = (1 if inner == "SRA" else per_host - 1) if intra_compress else 0
    return inner_partial + cross_partial, final
