"""Adaptive per-layer bits (L-GreCo): the dynamic program, real gradients, and the hook."""

from __future__ import annotations

import inspect
import itertools
import os
import random

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx
from cgx.adaptive import choose_settings, normalized_error
from harness import init_cgx, run_ranks, values


def brute_force(errors, costs, budget):
    layers = list(errors)
    best = None
    for combo in itertools.product(*(list(errors[n]) for n in layers)):
        err = sum(errors[n][c] for n, c in zip(layers, combo))
        cost = sum(costs[n][c] for n, c in zip(layers, combo))
        if err <= budget and (best is None or cost < best[0]):
            best = (cost, dict(zip(layers, combo)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_dynamic_program_matches_brute_force(seed):
    rng = random.Random(seed)
    candidates = [cgx.LayerSetting(b, 512) for b in (2, 3, 4, 8)]
    layers = [f"layer{i}" for i in range(rng.randint(1, 5))]
    # Integer errors and a budget of as many steps as its value: the program is exact.
    errors = {n: {c: rng.randint(0, 40) for c in candidates} for n in layers}
    costs = {n: {c: rng.randint(1, 100) for c in candidates} for n in layers}
    budget = rng.randint(0, 40 * len(layers))
    expected = brute_force(errors, costs, budget)
    plan = choose_settings(errors, costs, budget, resolution=max(1, budget))
    if expected is None:  # nothing fits: lowest error everywhere
        assert all(errors[n][plan[n]] == min(errors[n].values()) for n in layers)
        return
    assert sum(errors[n][plan[n]] for n in layers) <= budget
    assert sum(costs[n][plan[n]] for n in layers) == expected[0]


@pytest.mark.parametrize("seed", range(30))
def test_dynamic_program_with_rounding_never_costs_more_than_the_default(seed):
    """Float errors on a coarse grid: the program loses up to one grid step of budget per
    layer, so it finds at least the optimum of the budget less that, never exceeds the
    budget, and never costs more than the uniform default it was measured against."""
    rng = random.Random(seed)
    candidates = [cgx.LayerSetting(b, 512) for b in (2, 3, 4, 8)]
    layers = [f"layer{i}" for i in range(rng.randint(1, 5))]
    errors = {n: {c: rng.uniform(0, 10) / c.bits for c in candidates} for n in layers}
    costs = {n: {c: rng.randint(1, 20) * c.bits for c in candidates} for n in layers}
    default = candidates[2]
    budget = sum(errors[n][default] for n in layers)
    resolution = 20
    plan = choose_settings(errors, costs, budget, resolution=resolution,
                           baseline={n: default for n in layers})
    cost = sum(costs[n][plan[n]] for n in layers)
    assert sum(errors[n][plan[n]] for n in layers) <= budget * (1 + 1e-12)
    assert cost <= sum(costs[n][default] for n in layers)
    tighter = brute_force(errors, costs, budget * (1 - len(layers) / resolution))
    if tighter is not None:
        assert cost <= tighter[0]


def test_identical_layers_keep_the_uniform_default():
    # Three identical layers: uniform 4 bits fits the budget exactly; rounding each
    # layer's error up must not push the choice to a dearer plan.
    four, eight = cgx.LayerSetting(4, 512), cgx.LayerSetting(8, 512)
    errors = {n: {four: 1.0, eight: 0.1} for n in "abc"}
    costs = {n: {four: 4, eight: 8} for n in "abc"}
    plan = choose_settings(errors, costs, 3.0, resolution=7, baseline={n: four for n in "abc"})
    assert plan == {n: four for n in "abc"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="budget"):
        choose_settings({}, {}, -1.0)
    with pytest.raises(ValueError, match="default"):
        cgx.AdaptiveBits(candidates=[(2, 512)], default=(4, 512))
    with pytest.raises(ValueError, match="interval"):
        cgx.AdaptiveBits(interval=0)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        cgx.AdaptiveBits(candidates=[(32, 512), (4, 512)])
    with pytest.raises(ValueError, match="bucket_size"):
        cgx.AdaptiveBits(candidates=[(4, 2**31)], default=(4, 2**31))
    for alpha in (float("inf"), float("nan"), 0, -1, "2"):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            cgx.AdaptiveBits(alpha=alpha)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        cgx.AdaptiveBits(candidates=[(True, 512), (4, 512)])  # a bool is no bit count


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2, context=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(context, dim) * 0.02)
        block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def text_batches(batch=16, context=32):
    """Real text: CPython's own os.py, as bytes."""
    data = torch.tensor(list(inspect.getsource(os).encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    while True:
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + context] for s in starts])
        y = torch.stack([data[s + 1 : s + context + 1] for s in starts])
        yield x, y


def test_plan_on_real_gradients_sends_fewer_bytes_within_the_error_budget():
    torch.manual_seed(0)
    model = TinyGPT()
    settings = cgx.CompressionPolicy(bits=4).resolve(model)
    adaptive = cgx.AdaptiveBits(default=(4, 512))  # alpha 3
    batches = text_batches()
    for _ in range(3):
        x, y = next(batches)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        for name, p in model.named_parameters():
            if settings[name].compressed:
                adaptive.accumulate(name, p.grad)
    plan = adaptive.choose()
    grads = adaptive.accumulated
    default = adaptive.default
    chosen_bytes = sum(cgx.compressed_size(g.numel(), plan[n].bits, plan[n].bucket_size) for n, g in grads.items())
    default_bytes = sum(cgx.compressed_size(g.numel(), default.bits, default.bucket_size) for g in grads.values())
    chosen_error = sum(normalized_error(g, plan[n]) for n, g in grads.items())
    default_error = sum(normalized_error(g, default) for g in grads.values())
    assert len(grads) >= 6
    assert chosen_error <= adaptive.alpha * default_error * (1 + 1e-9)
    assert chosen_bytes < default_bytes
    assert len({s.bits for s in plan.values()}) > 1  # really per layer


def _adaptive_ddp(rank, world):
    init_cgx(rank, world)
    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DDP(model)
    adaptive = cgx.AdaptiveBits(interval=2)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4), adaptive=adaptive)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = text_batches()
    for _ in range(rank):  # different data on each rank
        next(batches)
    for _ in range(5):
        x, y = next(batches)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    plans = [None] * world
    dist.all_gather_object(plans, {n: (s.bits, s.bucket_size) for n, s in state.layer_settings.items()})
    return all(torch.equal(gathered[0], p) for p in gathered), all(p == plans[0] for p in plans), plans[0]


def test_adaptive_hook_applies_one_plan_on_all_ranks():
    for same_params, same_plan, plan in values(run_ranks(_adaptive_ddp, 2)):
        assert same_params and same_plan
        assert {bits for bits, _ in plan.values()} - {32, 4}  # some layer moved off 4 bits
