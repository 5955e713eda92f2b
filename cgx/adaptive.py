"""Adaptive per-layer bits (L-GreCo): spend bits where quantization hurts most.

Every ``interval`` steps, for each compressed layer and each candidate setting, measure
the quantization error on the gradients g accumulated since the last choice, in units of
that layer's own mean square (``normalized_error``: ``|Q(g) - g|^2 / mean(g^2)``), and
its cost (compressed bytes). A dynamic program then picks one candidate per layer
minimising total bytes subject to

    total error <= alpha * total error of the uniform default setting.

Why normalized: an adaptive optimizer (Adam) scales each parameter's step by its
gradient's running magnitude, so an error matters in proportion to the layer's gradient
scale. Raw squared error (L-GreCo's yardstick) lets the layers with the largest
gradients claim the whole budget and starves the small-gradient layers, which Adam then
moves by noise: measured on the GPT benchmark, it sent 7% fewer bytes than uniform 4
bits at a 1.2% worse loss (docs/benchmarks.md).

Rank 0 decides and broadcasts; every rank applies the same plan from the next step.

Example::

    adaptive = cgx.AdaptiveBits(candidates=[(2, 128), (2, 512), (3, 512), (4, 512), (8, 512)],
                                default=(4, 512), alpha=3.0, interval=100)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4), adaptive=adaptive)
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from cgx import _C
from cgx.config import check_int
from cgx.layers import LayerSetting, check_bits, check_bucket_size, check_setting

__all__ = ["AdaptiveBits", "choose_settings", "normalized_error", "quantization_error"]


def quantization_error(values: torch.Tensor, setting: LayerSetting) -> float:
    """Squared L2 error of quantizing `values` with `setting`."""
    flat = values.reshape(-1).float()
    decoded = _C.decompress(
        _C.compress(flat, setting.bits, setting.bucket_size, scheme=setting.scheme), flat.numel(),
        setting.bits, setting.bucket_size, scheme=setting.scheme,
    )
    return float((decoded - flat).double().pow(2).sum())


def normalized_error(values: torch.Tensor, setting: LayerSetting) -> float:
    """quantization_error in units of the values' mean square (0 for all-zero values)."""
    mean_square = float(values.double().pow(2).mean()) if values.numel() else 0.0
    return quantization_error(values, setting) / mean_square if mean_square > 0 else 0.0


def choose_settings(
    errors: Mapping[str, Mapping[LayerSetting, float]],
    costs: Mapping[str, Mapping[LayerSetting, int]],
    budget: float,
    resolution: int = 4000,
    baseline: Mapping[str, LayerSetting] | None = None,
) -> dict[str, LayerSetting]:
    """One candidate per layer minimising the total cost with total error <= budget.

    Dynamic program over layers, the error axis cut into `resolution` steps of
    budget / resolution; each error is rounded up to whole steps, so the choice never
    exceeds the budget. The rounding can lose up to one step per layer, so the program
    may miss a plan that fits by less than that; `baseline` (the uniform default the
    budget was measured on) is returned instead where it fits and costs less, so the
    choice never sends more than the default. Ties go to the lower error. If no plan
    fits, each layer gets its lowest-error candidate.
    """
    if budget < 0 or not math.isfinite(budget):
        raise ValueError(f"budget must be finite and >= 0, got {budget}")
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    layers = list(errors)
    step = budget / resolution if budget > 0 else 1.0
    inf = float("inf")
    # best[e]: least cost of the layers so far using exactly e error steps.
    best = [0.0] + [inf] * resolution
    choices: list[list[tuple[int, LayerSetting] | None]] = []
    for layer in layers:
        options = sorted(errors[layer].items(), key=lambda kv: (kv[1], costs[layer][kv[0]]))
        new = [inf] * (resolution + 1)
        picked: list[tuple[int, LayerSetting] | None] = [None] * (resolution + 1)
        for setting, err in options:
            units = math.ceil(err / step - 1e-9) if budget > 0 else (0 if err == 0 else resolution + 1)
            if units > resolution:
                continue
            cost = costs[layer][setting]
            for e in range(resolution - units, -1, -1):
                total = best[e] + cost
                if total < new[e + units]:
                    new[e + units] = total
                    picked[e + units] = (e, setting)
        best = new
        choices.append(picked)
    end = min(range(resolution + 1), key=lambda e: (best[e], e))

    def total(plan, table):
        return sum(table[layer][plan[layer]] for layer in layers)

    baseline_fits = baseline is not None and total(baseline, errors) <= budget
    if best[end] == inf:
        if baseline_fits:
            return dict(baseline)
        return {layer: min(errors[layer], key=lambda s: errors[layer][s]) for layer in layers}
    plan = {}
    for layer, picked in zip(reversed(layers), reversed(choices)):
        previous, setting = picked[end]
        plan[layer] = setting
        end = previous
    if baseline_fits and total(baseline, costs) < total(plan, costs):
        return dict(baseline)
    return plan


class AdaptiveBits:
    """Periodic L-GreCo selection for :class:`cgx.CGXState` (``adaptive=``).

    Args:
        candidates: (bits, bucket_size, scheme) triples a layer may use ("maxmin" or
            "hadamard"; a (bits, bucket_size) pair is maxmin); smaller buckets cost more
            bytes (8 per bucket, 4 with hadamard) and err less, a second dimension beside
            the bits. The default (since cgx 0.2, with the default scheme): hadamard at 2,
            3 and 4 bits, maxmin at 4, 6 and 8, measured on four tasks
            (docs/benchmarks.md, "cgx-adaptive-hadamard").
        default: the uniform setting the error budget is measured against; must be a
            candidate.
        alpha: allowed total error as a multiple of the default's. At 1 the choice
            stays close to uniform (errors relative to each layer's scale differ little
            between layers); the default 3 measured, on the GPT benchmark, 14.5% fewer
            bytes than uniform 4 bits at a 0.15% lower loss, mean of three seeds
            (docs/benchmarks.md).
        interval: steps between choices (gradients accumulate in between).
    """

    def __init__(
        self,
        candidates: Iterable[tuple] = ((2, 512, "hadamard"), (2, 128, "hadamard"), (3, 512, "hadamard"),
                                       (4, 512, "hadamard"), (4, 512, "maxmin"), (6, 512, "maxmin"),
                                       (8, 512, "maxmin")),
        default: tuple = (4, 512, "maxmin"),
        *,
        alpha: float = 3.0,
        interval: int = 100,
    ) -> None:
        self.candidates = tuple(LayerSetting(*c) for c in candidates)
        for c in self.candidates:
            check_bits(c.bits, f"cgx.AdaptiveBits candidate {c}", allow_raw=False)
            check_bucket_size(c.bucket_size, f"cgx.AdaptiveBits candidate {c}")
            check_setting(c.bits, c.bucket_size, c.scheme, f"cgx.AdaptiveBits candidate {c}")
        self.default = LayerSetting(*default)
        if self.default not in self.candidates:
            raise ValueError(f"cgx.AdaptiveBits: default {default} is not among the candidates")
        if not (isinstance(alpha, (int, float)) and 0 < alpha < math.inf):
            raise ValueError(f"cgx.AdaptiveBits: alpha must be a finite number > 0, got {alpha!r}")
        check_int(interval, "interval", "cgx.AdaptiveBits", low=1)
        self.alpha = alpha
        self.interval = interval
        self.accumulated: dict[str, torch.Tensor] = {}

    def accumulate(self, name: str, grad: torch.Tensor) -> None:
        acc = self.accumulated.get(name)
        if acc is None or acc.numel() != grad.numel():
            self.accumulated[name] = grad.detach().float().clone()
        else:
            acc += grad.detach().float()

    def choose(self) -> dict[str, LayerSetting]:
        """A plan for the layers accumulated so far."""
        errors = {n: {c: normalized_error(g, c) for c in self.candidates} for n, g in self.accumulated.items()}
        costs = {
            n: {c: _C.compressed_size(g.numel(), c.bits, c.bucket_size, scheme=c.scheme) for c in self.candidates}
            for n, g in self.accumulated.items()
        }
        budget = self.alpha * sum(e[self.default] for e in errors.values())
        uniform = {n: self.default for n in errors}
        return choose_settings(errors, costs, budget, baseline=uniform)
