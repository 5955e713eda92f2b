"""The cgx DDP comm hook: per-layer plans, error feedback, warm-up, checkpoints."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bounds import allreduce_error_bound
from harness import init_cgx, run_ranks, values


class AllreduceInBackward(torch.autograd.Function):
    """Identity forward; its backward all_reduces a metric on the same group, between
    DDP's bucket hooks (as a distributed loss or a sync-BN would)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        metric = torch.full((1000,), float(dist.get_rank()))
        dist.all_reduce(metric)  # compressed or not, on the cgx group
        return grad


class Net(torch.nn.Module):
    def __init__(self, interleave: bool = False, unused: bool = False):
        super().__init__()
        self.embed = torch.nn.Linear(32, 128)
        self.hidden = torch.nn.Linear(128, 128)
        self.norm = torch.nn.LayerNorm(128)
        self.head = torch.nn.Linear(128, 10)
        self.spare = torch.nn.Linear(4, 4) if unused else None
        self.interleave = interleave

    def forward(self, x):
        h = torch.relu(self.embed(x))
        if self.interleave:
            h = AllreduceInBackward.apply(h)
        h = self.norm(torch.relu(self.hidden(h)))
        if self.interleave:
            h = AllreduceInBackward.apply(h)
        return self.head(h)


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Net(**kwargs)


def batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 10, (16,), generator=g)


def flat_params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def train(ddp, model, rank, steps, start=0, dtype=torch.float32, opt=None, check_every_step=False):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    same = True
    for step in range(start, start + steps):
        x, y = batch(rank, step, dtype)
        loss = torch.nn.functional.cross_entropy(ddp(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if check_every_step:
            mine = flat_params(model)
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            same = same and all(torch.equal(everyone[0], p) for p in everyone)
    return opt, same


def _hook_at_32_bits_equals_plain_ddp(rank, world):
    import cgx

    init_cgx(rank, world)
    plain = make_model()
    train(DDP(plain), plain, rank, 4)
    hooked = make_model()
    ddp = DDP(hooked)
    ddp.register_comm_hook(cgx.CGXState(None, hooked, cgx.CompressionPolicy(bits=32)), cgx.cgx_hook)
    train(ddp, hooked, rank, 4)
    return torch.equal(flat_params(plain), flat_params(hooked))


def test_hook_at_32_bits_is_identical_to_plain_ddp():
    assert all(values(run_ranks(_hook_at_32_bits_equals_plain_ddp, 2)))


def _one_step_error(rank, world, bits):
    import cgx

    init_cgx(rank, world)
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=bits), error_feedback=False)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    x, y = batch(rank, 0)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    # The exact average, from every rank's local gradients.
    reference = make_model()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    out = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        local = q.grad.reshape(-1)
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        exact = torch.stack(everyone).sum(0) / world
        error = float((p.grad.reshape(-1) - exact).abs().max())
        setting = state.layer_settings[name]
        if setting.compressed:
            bound = allreduce_error_bound([g / world for g in everyone], setting.bits)
        else:
            bound = 1e-6 * float(exact.abs().max()) + 1e-9  # raw: float summation order only
        out[name] = (error, bound, setting.compressed)
    return out, state.compression_stats()


@pytest.mark.parametrize("bits", [2, 4])
def test_hook_error_bounded_and_layers_follow_policy(bits):
    for per_layer, stats in values(run_ranks(_one_step_error, 3, args=(bits,))):
        for name, (error, bound, compressed) in per_layer.items():
            assert error <= bound, (name, error, bound)
        # Weights compressed, biases and the norm exact, as in CGX.
        assert per_layer["hidden.weight"][2] and not per_layer["hidden.bias"][2]
        assert not per_layer["norm.weight"][2]
        assert stats["compression_ratio"] > (3 if bits == 4 else 5)
        assert set(stats["layer_errors"]) == {"embed.weight", "hidden.weight", "head.weight"}


def _interleaved(rank, world):
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=8, minimal_size=0))
    model = make_model(interleave=True)
    ddp = DDP(model, bucket_cap_mb=0.02)
    policy = cgx.CompressionPolicy(bits=2, rules=[cgx.LayerRule(pattern="head.*", bits=32)])
    state = cgx.CGXState(None, model, policy)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    head_exact = True
    same = True
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        # The raw head layer is the exact average despite the allreduces in between.
        reference = make_model()
        reference.load_state_dict(model.state_dict())
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        local = reference.head.weight.grad.reshape(-1)
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        exact = torch.stack(everyone).sum(0) / world
        head_exact = head_exact and bool(torch.allclose(model.head.weight.grad.reshape(-1), exact, rtol=1e-5, atol=1e-7))
        opt.step()
        metric = torch.ones(5000)
        dist.all_reduce(metric)  # loss averaging between steps
        mine = flat_params(model)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        same = same and all(torch.equal(gathered[0], g) for g in gathered)
    return head_exact, same, state.layer_settings["embed.weight"].bits


def test_other_allreduces_between_buckets_do_not_disturb_the_plan():
    for head_exact, same, embed_bits in values(run_ranks(_interleaved, 2)):
        assert head_exact and same and embed_bits == 2


def _variants(rank, world, variant):
    import cgx

    init_cgx(rank, world)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(variant, torch.float32)
    model = make_model(unused=variant == "unused").to(dtype)
    kwargs = {"static_graph": True} if variant == "static" else {}
    if variant == "unused":
        kwargs = {"find_unused_parameters": True}
    ddp = DDP(model, bucket_cap_mb=0.02, **kwargs)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4), warmup_steps=2)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    _, same = train(ddp, model, rank, 5, dtype=dtype, check_every_step=True)
    return same, state.step, state.compression_stats()["compression_ratio"]


@pytest.mark.parametrize("variant", ["fp16", "bf16", "static", "unused"])
def test_dtypes_static_graph_unused_parameters(variant):
    for same, step, ratio in values(run_ranks(_variants, 2, args=(variant,))):
        assert same and step == 5
        assert ratio > 1.5  # 2 warm-up steps raw, then compressed


def _no_sync(rank, world):
    import cgx

    init_cgx(rank, world)
    model = make_model()
    ddp = DDP(model)
    ddp.register_comm_hook(cgx.CGXState(None, model, cgx.CompressionPolicy(bits=8), error_feedback=False), cgx.cgx_hook)
    with ddp.no_sync():
        for micro in range(2):
            x, y = batch(rank, micro)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    x, y = batch(rank, 2)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    reference = make_model()
    for micro in range(3):
        x, y = batch(rank, micro)
        torch.nn.functional.cross_entropy(reference(x), y).backward()
    local = reference.hidden.weight.grad.reshape(-1)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    exact = torch.stack(everyone).sum(0) / world
    error = float((model.hidden.weight.grad.reshape(-1) - exact).abs().max())
    return error, allreduce_error_bound([g / world for g in everyone], 8), float(exact.abs().max())


def test_no_sync_accumulates_then_reduces_the_sum():
    for error, bound, scale in values(run_ranks(_no_sync, 2)):
        assert error <= bound and bound < 0.1 * scale


def _checkpoint(rank, world):
    import cgx

    init_cgx(rank, world)

    def setup():
        model = make_model()
        ddp = DDP(model)
        state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=2), warmup_steps=1)
        ddp.register_comm_hook(state, cgx.cgx_hook)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, ddp, state, opt = setup()
    train(ddp, model, rank, 3, opt=opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cgx": state.state_dict()}, buf)
    train(ddp, model, rank, 1, start=3, opt=opt)
    uninterrupted = flat_params(model)

    model, ddp, state, opt = setup()
    buf.seek(0)
    saved = torch.load(buf)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["cgx"])
    train(ddp, model, rank, 1, start=3, opt=opt)
    resumed = flat_params(model)

    copy = pickle.loads(pickle.dumps(state))
    pickled_ok = copy.process_group is None and copy.step == state.step and set(copy.residuals) == set(state.residuals)
    copy.attach(model)
    return torch.equal(uninterrupted, resumed), bool(state.residuals), pickled_ok


def test_checkpoint_round_trip_resumes_exactly():
    for same, had_residuals, pickled_ok in values(run_ranks(_checkpoint, 2)):
        assert same and had_residuals and pickled_ok


def test_bad_configuration_raises_value_error():
    import cgx

    for bits in (0, 9):
        with pytest.raises(ValueError, match="bits"):
            cgx.CompressionPolicy(bits=bits)
        with pytest.raises(ValueError, match="bits"):
            cgx.LayerRule(pattern="*", bits=bits)
    with pytest.raises(ValueError, match="bucket_size"):
        cgx.CompressionPolicy(bucket_size=-1)
    with pytest.raises(ValueError, match="minimal_size"):
        cgx.CompressionPolicy(minimal_size=-5)
    with pytest.raises(ValueError, match="max_numel"):
        cgx.LayerRule(max_numel=-1)
    with pytest.raises(ValueError, match="at least one"):
        cgx.LayerRule(bits=8)
    with pytest.raises(ValueError, match="warmup_steps"):
        cgx.CGXState(None, make_model(), warmup_steps=-1)
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        cgx.CGXState(None, make_model(), cgx.CompressionPolicy(rules=[cgx.LayerRule(pattern="enbed.*", bits=8)]))


def test_policy_resolution_rules_and_defaults():
    import cgx

    policy = cgx.CompressionPolicy(
        bits=4,
        rules=[
            cgx.LayerRule(module_type=torch.nn.LayerNorm, bits=8),
            cgx.LayerRule(pattern="head.*", bits=6, bucket_size=64),
            cgx.LayerRule(pattern="embed.*", max_numel=5000, bits=2),
        ],
    )
    settings = policy.resolve(make_model())
    assert settings["norm.weight"] == cgx.LayerSetting(8, 512)  # first match wins over 1-D default
    assert settings["head.weight"] == cgx.LayerSetting(6, 64)
    assert settings["embed.weight"] == cgx.LayerSetting(2, 512)  # 4096 elements
    assert settings["hidden.weight"] == cgx.LayerSetting(4, 512)  # default
    assert settings["hidden.bias"] == cgx.LayerSetting(32, 512)  # 1-D: raw by default
    assert settings["embed.bias"] == cgx.LayerSetting(2, 512)  # a rule beats the 1-D default
    assert cgx.LayerRule(max_numel=100, bits=2).matches("x", torch.nn.Linear(1, 1), 101) is False
