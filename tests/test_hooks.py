"""The cgx DDP comm hook: per-layer plans, error feedback, warm-up, checkpoints."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bounds import allreduce_error_bound
from harness import init_cgx, load_everyones_state, run_ranks, values


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


def test_old_stats_names_still_read_with_a_deprecation_warning():
    import cgx

    model = torch.nn.Linear(64, 64)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4))
    state.payload_bytes, state.uncompressed_payload_bytes = 10, 40
    with pytest.warns(DeprecationWarning, match=r"CGXState.stats\(\)"):
        old = state.compression_stats()
    assert old == state.stats()
    assert set(old) == {"step", "payload_bytes", "uncompressed_payload_bytes", "compression_ratio", "layer_errors",
                        "exact_calls", "exact_bytes", "exact_why"}
    with pytest.warns(DeprecationWarning, match="'payload_bytes'"):
        assert old["bytes_sent"] == 10
    with pytest.warns(DeprecationWarning, match="'uncompressed_payload_bytes'"):
        assert old.get("bytes_uncompressed") == 40
    with pytest.warns(DeprecationWarning, match="CGXState.payload_bytes"):
        assert state.bytes_sent == 10
    with pytest.warns(DeprecationWarning, match="CGXState.uncompressed_payload_bytes"):
        assert state.bytes_uncompressed == 40
    with pytest.raises(KeyError):
        old["bytes_sent_twice"]
    assert old.get("bytes_sent_twice", "none") == "none"
    with pytest.warns(DeprecationWarning) as caught:
        assert "bytes_sent" in old and old.get("bytes_sent") == 10
    assert {w.filename for w in caught} == {__file__}  # attributed to the caller: shown by default in __main__
    assert "bytes_sent_twice" not in old
    assert "peak_bytes" not in old  # counters.RENAMED's entry for a key the hook has not
    # A checkpoint holding stats() loads with torch.load's default weights_only=True.
    buffer = io.BytesIO()
    torch.save({"stats": state.stats()}, buffer)
    buffer.seek(0)
    assert torch.load(buffer)["stats"] == state.stats()
    # A checkpoint and a pickle from before the names changed still load.
    saved = state.state_dict()
    saved["bytes_sent"], saved["bytes_uncompressed"] = saved.pop("payload_bytes"), saved.pop("uncompressed_payload_bytes")
    resumed = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4))
    resumed.load_state_dict(saved)
    pickled = state.__getstate__()
    pickled["bytes_sent"], pickled["bytes_uncompressed"] = pickled.pop("payload_bytes"), pickled.pop("uncompressed_payload_bytes")
    revived = cgx.CGXState.__new__(cgx.CGXState)
    revived.__setstate__(pickled)
    for loaded in (resumed, revived):
        assert (loaded.payload_bytes, loaded.uncompressed_payload_bytes) == (10, 40)


def _subgroup_checkpoints(rank, world):
    import cgx

    init_cgx(rank, world)
    pairs = [dist.new_group([0, 1], backend="cgx"), dist.new_group([2, 3], backend="cgx")]
    model = torch.nn.Linear(64, 64)
    state = cgx.CGXState(pairs[rank // 2], model, cgx.CompressionPolicy(bits=2))
    state.residuals["weight"] = torch.full((64 * 64,), float(rank))
    return load_everyones_state(state.state_dict, state.load_state_dict)


def test_checkpoint_of_the_same_rank_of_another_group_is_refused():
    # Ranks 0 and 2 are each rank 0 of a pair (DDP inside each host of a per-host
    # DiLoCo): their residuals differ, so neither loads the other's.
    for rank, outcome in enumerate(values(run_ranks(_subgroup_checkpoints, 4))):
        assert outcome[rank] == "loaded", outcome
        for saver in set(outcome) - {rank}:
            assert f"(global rank {saver})" in outcome[saver], outcome[saver]


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
    return out, state.stats()


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


def _reference_average(model, x, y, world):
    """Every parameter's exact averaged gradient, and the per-rank local gradients."""
    reference = make_model()
    reference.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    out = {}
    for name, p in reference.named_parameters():
        local = p.grad.reshape(-1)
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        out[name] = (torch.stack(everyone).sum(0) / world, [g / world for g in everyone])
    return out


def _interleaved(rank, world):
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=8, minimal_size=0, compression_auto=False))
    model = make_model(interleave=True)
    ddp = DDP(model, bucket_cap_mb=0.02)
    # embed's gradient is ready last: after DDP rebuilds its buckets (step 1 on) it is
    # alone in the last bucket, reduced after a metric allreduce on the same group.
    policy = cgx.CompressionPolicy(bits=2, rules=[cgx.LayerRule(pattern="embed.*", bits=32)])
    state = cgx.CGXState(None, model, policy, error_feedback=False)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    failures = []
    same = True
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        for name, (exact, parts) in _reference_average(model, x, y, world).items():
            got = dict(model.named_parameters())[name].grad.reshape(-1)
            setting = state.layer_settings[name]
            if setting.compressed:
                ok = float((got - exact).abs().max()) <= allreduce_error_bound(parts, setting.bits)
            else:  # raw: the exact average despite the allreduces in between
                ok = bool(torch.allclose(got, exact, rtol=1e-5, atol=1e-7))
            if not ok:
                failures.append((step, name))
        opt.step()
        metric = torch.ones(5000)
        dist.all_reduce(metric)  # loss averaging between steps
        mine = flat_params(model)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        same = same and all(torch.equal(gathered[0], g) for g in gathered)
    return failures, same, state.layer_settings["hidden.weight"].compressed


def test_other_allreduces_between_buckets_do_not_disturb_the_plan():
    for failures, same, compressed in values(run_ranks(_interleaved, 2)):
        assert failures == [] and same and compressed


class Linear64(torch.nn.Module):
    """loss = <w, c>: the gradient is c, whatever w is."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, c):
        return (self.weight * c).sum()


def _cumulative_error(rank, world, feedback, dtype, algorithm, scheme):
    """A constant gradient (loss = <w, c_rank>) reduced step after step: the averaged
    gradients DDP hands the optimizer should add up to steps x the mean of c. Returns the
    largest error of that running total (summed in float64) at each checkpoint step, and
    the largest value of the mean c (one step's gradient)."""
    import cgx

    init_cgx(rank, world)
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(inner_reduction=algorithm,
                                                                  compression_auto=False))  # every step compressed
    torch.manual_seed(0)
    model = Linear64().to(dtype)
    c = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank)).to(dtype)
    ddp = DDP(model, process_group=group)
    state = cgx.CGXState(group, model, cgx.CompressionPolicy(bits=2, bucket_size=64, scheme=scheme),
                         error_feedback=feedback != "none", two_level=feedback == "two-level")
    ddp.register_comm_hook(state, cgx.cgx_hook)
    everyone = [torch.empty_like(c) for _ in range(world)]
    dist.all_gather(everyone, c)
    mean = torch.stack([e.double() for e in everyone]).mean(0)
    total = torch.zeros_like(mean)
    errors = {}
    for step in range(1, 161):
        model.zero_grad()
        ddp(c).backward()
        total += model.weight.grad.double()
        if step in (10, 40, 160):
            errors[step] = float((total - step * mean).abs().max())
    return errors, float(mean.abs().max())


@pytest.mark.parametrize("dtype,algorithm,world,scheme",
                         [(torch.float32, "SRA", 2, "maxmin"), (torch.float16, "SRA", 2, "maxmin"),
                          (torch.float32, "Ring", 3, "maxmin"), (torch.float32, "SRA", 2, "hadamard")])
def test_two_level_error_feedback_keeps_the_accumulated_error_bounded(dtype, algorithm, world, scheme):
    """The bound: two-level feedback re-sends everything either stage dropped, so the
    error of the running total is what the residuals hold at that moment: with maxmin
    less than one step's gradient (max |mean c|) at 10, 40 and 160 steps alike; with
    hadamard, whose 2-bit levels clip a value beyond its outer level, a quarter more, and
    level from step 10 on (3.70 at 640 steps where it is 2.69 at 10). One-level feedback
    leaves the owner's re-quantization of the sum, the same rounding every step, so its
    error grows with the steps; without feedback it grows faster still."""
    runs = {f: values(run_ranks(_cumulative_error, world, args=(f, dtype, algorithm, scheme)))
            for f in ("two-level", "one-level", "none")}
    for rank in range(world):
        two, scale = runs["two-level"][rank]
        one, _ = runs["one-level"][rank]
        none, _ = runs["none"][rank]
        # float16 rounds each step's averaged gradient to its dtype, not fed back.
        slack = 0.25 * scale if dtype == torch.float16 or scheme == "hadamard" else 0.0
        assert max(two.values()) < scale + slack, (two, scale)
        assert two[160] < 1.5 * two[10], two
        assert one[160] > 3 * one[10] and one[160] > 5 * scale, one  # the drift is real
        assert none[160] > one[160], (none, one)
        assert runs["two-level"][rank] == runs["two-level"][0]  # every rank moved alike


def _group_rounding_settings(rank, world):
    import cgx

    init_cgx(rank, world)
    out = {}
    # Partial last buckets travel raw: the residual there is zero.
    skip = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, skip_incomplete_buckets=True))
    model = make_model()
    ddp = DDP(model, process_group=skip)
    state = cgx.CGXState(skip, model, error_feedback=True)  # policy from the group: 4 bits, bucket 512
    ddp.register_comm_hook(state, cgx.cgx_hook)
    x, y = batch(rank, 0)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    residual = state.residuals["head.weight"]  # 1280 values: 2 whole buckets + 256
    out["skip"] = (state.layer_settings["head.weight"], bool(residual[1024:].eq(0).all()),
                   bool(residual[:1024].ne(0).any()))
    # Stochastic rounding and one-level feedback (a local round-to-nearest estimate) do not
    # mix: a clear error, on every rank.
    stochastic = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, stochastic_rounding=True))
    model = make_model()
    ddp = DDP(model, process_group=stochastic)
    ddp.register_comm_hook(cgx.CGXState(stochastic, model, two_level=False), cgx.cgx_hook)
    try:
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        out["stochastic"] = "no error"
    except Exception as e:  # DDP may wrap it
        out["stochastic"] = str(e)
    # Two-level feedback records what the stochastic rounding really dropped: it trains,
    # replicas identical, and keeps a residual.
    model = make_model()
    ddp = DDP(model, process_group=stochastic)
    state = cgx.CGXState(stochastic, model, error_feedback=True)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    _, same = train(ddp, model, rank, 3, check_every_step=True)
    out["stochastic two-level"] = same and bool(state.residuals["head.weight"].ne(0).any())
    return out


def test_hook_follows_the_groups_rounding_settings():
    import cgx

    for out in values(run_ranks(_group_rounding_settings, 2)):
        setting, tail_zero, head_nonzero = out["skip"]
        assert setting == cgx.LayerSetting(4, 512, "hadamard") and tail_zero and head_nonzero
        assert "two_level=False" in out["stochastic"] and "stochastically" in out["stochastic"]
        assert out["stochastic two-level"]


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
    opt, same_warm = train(ddp, model, rank, 2, dtype=dtype, check_every_step=True)
    warm = state.stats()
    _, same = train(ddp, model, rank, 3, start=2, dtype=dtype, opt=opt, check_every_step=True)
    end = state.stats()
    numel = sum(p.numel() for p in model.parameters())
    return same_warm and same, state.step, warm, end, numel, model.hidden.weight.element_size()


@pytest.mark.parametrize("variant", ["fp16", "bf16", "static", "unused"])
def test_dtypes_static_graph_unused_parameters(variant):
    for same, step, warm, end, numel, element_size in values(run_ranks(_variants, 2, args=(variant,))):
        assert same and step == 5
        # 2 warm-up steps raw: float32 on the wire, whatever the dtype; then compressed.
        assert warm["payload_bytes"] == 2 * 4 * numel and warm["uncompressed_payload_bytes"] == 2 * element_size * numel
        compressed_ratio = (end["uncompressed_payload_bytes"] - warm["uncompressed_payload_bytes"]) / (
            end["payload_bytes"] - warm["payload_bytes"])
        assert compressed_ratio > 1.5, compressed_ratio


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


def _checkpoint(rank, world, two_level):
    import cgx

    init_cgx(rank, world)

    def setup():
        model = make_model()
        ddp = DDP(model)
        # Adaptive choices at steps 2 and 4: the checkpoint falls between them.
        adaptive = cgx.AdaptiveBits(interval=2)
        state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=2), warmup_steps=1,
                             adaptive=adaptive, error_feedback=True, two_level=two_level)
        ddp.register_comm_hook(state, cgx.cgx_hook)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, ddp, state, opt = setup()
    train(ddp, model, rank, 3, opt=opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cgx": state.state_dict()}, buf)
    if two_level:
        # Two-level residuals depend on which rank owned which part of a layer, and DDP's
        # first iteration lays its buckets out otherwise than the later ones: the run to
        # match goes on in a new DDP too, with the state it has in memory.
        ddp = DDP(model)
        ddp.register_comm_hook(state, cgx.cgx_hook)
    train(ddp, model, rank, 2, start=3, opt=opt)
    uninterrupted = flat_params(model), dict(state.layer_settings)

    model, ddp, state, opt = setup()
    buf.seek(0)
    saved = torch.load(buf)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["cgx"])
    train(ddp, model, rank, 2, start=3, opt=opt)
    resumed = flat_params(model), dict(state.layer_settings)

    # Residuals are per rank: loading another rank's state is refused.
    theirs = [None] * world
    dist.all_gather_object(theirs, saved["cgx"])
    try:
        state.load_state_dict(theirs[(rank + 1) % world])
        wrong_rank = "accepted"
    except ValueError as e:
        wrong_rank = str(e)
    # So are residuals of a group of another size; without residuals the rest loads.
    try:
        state.load_state_dict({**saved["cgx"], "world_size": world + 1})
        wrong_size = "accepted"
    except ValueError as e:
        wrong_size = str(e)
    state.load_state_dict({**theirs[(rank + 1) % world], "world_size": world + 1, "residuals": {}})
    state.load_state_dict(saved["cgx"])

    # An unpickled state (without its process group) re-attached to a copy of the model
    # takes the same next step as the original.
    copy = pickle.loads(pickle.dumps(state))
    twin = make_model()
    twin.load_state_dict(model.state_dict())
    copy.attach(twin)
    twin_ddp = DDP(twin)
    twin_ddp.register_comm_hook(copy, cgx.cgx_hook)
    if two_level:  # both in DDP's first-iteration layout (see above)
        ddp = DDP(model)
        ddp.register_comm_hook(state, cgx.cgx_hook)
    train(ddp, model, rank, 1, start=5)
    train(twin_ddp, twin, rank, 1, start=5)
    pickled_ok = copy.process_group is None and torch.equal(flat_params(model), flat_params(twin))
    return (torch.equal(uninterrupted[0], resumed[0]), uninterrupted[1] == resumed[1],
            bool(state.residuals), wrong_rank + wrong_size, pickled_ok)


@pytest.mark.parametrize("two_level", [True, False])
def test_checkpoint_round_trip_resumes_exactly(two_level):
    """Resumes bit for bit: with two-level feedback, only if the owners' residuals (the
    second stage) are in the checkpoint too."""
    for same, same_plan, had_residuals, wrong_rank, pickled_ok in values(run_ranks(_checkpoint, 2, args=(two_level,))):
        assert same and same_plan and had_residuals and pickled_ok
        assert "every rank must save and load its own" in wrong_rank
        assert "saved in a group of 3 ranks, loaded in one of 2" in wrong_rank


def _torch_cgx_form(rank, world):
    """torch_cgx's call, unchanged: the same plan and the same training as the policy it
    means, given with the model; a checkpoint resumes exactly without a model too."""
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=4, bucket_size=512, compression_auto=False))

    def run(state_of, steps, start=0, checkpoint=None):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets, rebuilt after step 0
        state = state_of(model)
        ddp.register_comm_hook(state, cgx.cgx_hook)
        if checkpoint:
            model.load_state_dict(checkpoint["model"])
            state.load_state_dict(checkpoint["cgx"])
        _, same = train(ddp, model, rank, steps, start=start, check_every_step=True)
        return model, state, same

    torch_cgx = lambda model: cgx.CGXState(dist.group.WORLD, layer_min_size=1024,  # noqa: E731
                                           compression_params={"bits": 4, "bucket_size": 1024})
    meant = lambda model: cgx.CGXState(None, model, cgx.CompressionPolicy(  # noqa: E731
        bits=4, bucket_size=1024, minimal_size=1023))
    model, state, same = run(torch_cgx, 4)
    reference, reference_state, _ = run(meant, 4)
    out = {"replicas identical": same,
           "same training as the policy": torch.equal(flat_params(model), flat_params(reference)),
           "same residuals": sorted(r.sum().item() for r in state.residuals.values())
           == sorted(r.sum().item() for r in reference_state.residuals.values())}
    # Which layers: 2-D with >= 1024 elements (embed 4096, hidden 16384, head 1280).
    out["compressed layers"] = sorted(
        p.numel() for p in model.parameters()
        if state._settings_by_param[id(p)][1] == cgx.LayerSetting(4, 1024, "hadamard"))
    out["raw layers"] = sum(not s.compressed for s in state.layer_settings.values())
    # bits and bucket size from the group when compression_params leaves them out
    small = cgx.CGXState(None, layer_min_size=2000)
    out["group defaults"] = (small.policy.bits, small.policy.bucket_size, small.policy.minimal_size)

    # Without a model the state found the one DDP wraps: layers go by parameter name.
    out["named by parameter"] = set(state.layer_settings) == {n for n, _ in model.named_parameters()}
    # A checkpoint without a model resumes exactly. (One-level feedback: the resumed run's
    # first iteration lays DDP's buckets out otherwise, which moves two-level residuals
    # between owners; see test_checkpoint_round_trip_resumes_exactly.)
    one_level = lambda model: cgx.CGXState(dist.group.WORLD, layer_min_size=1024,  # noqa: E731
                                           compression_params={"bits": 4, "bucket_size": 1024},
                                           error_feedback=True, two_level=False)
    first, first_state, _ = run(one_level, 3)
    saved = {"model": first.state_dict(), "cgx": first_state.state_dict()}
    uninterrupted, _, _ = run(one_level, 5)
    resumed, _, _ = run(one_level, 2, start=3, checkpoint=saved)
    out["resumed exactly"] = torch.equal(flat_params(uninterrupted), flat_params(resumed))
    return out


def test_torch_cgx_call_unchanged():
    for out in values(run_ranks(_torch_cgx_form, 2)):
        assert out.pop("compressed layers") == [1280, 4096, 16384]
        assert out.pop("raw layers") == 5  # 3 biases and the LayerNorm's 2
        assert out.pop("group defaults") == (4, 512, 1999)
        failed = [name for name, ok in out.items() if not ok]
        assert not failed, failed


def _resume_with_other_buckets(rank, world, two_level):
    """torch_cgx's form with find_unused_parameters: a checkpoint resumed in a DDP with
    another bucket_cap_mb takes the same steps as the state that stayed in memory and
    moved to such a DDP: each residual lands on its own parameter."""
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=4, compression_auto=False))

    def setup(cap_mb):
        model = make_model(unused=True)
        ddp = DDP(model, bucket_cap_mb=cap_mb, find_unused_parameters=True)
        state = cgx.CGXState(dist.group.WORLD, layer_min_size=1024,
                             compression_params={"bits": 2, "bucket_size": 256}, two_level=two_level)
        ddp.register_comm_hook(state, cgx.cgx_hook)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, ddp, state, opt = setup(0.02)
    train(ddp, model, rank, 3, opt=opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cgx": state.state_dict()}, buf)
    moved = DDP(model, bucket_cap_mb=1, find_unused_parameters=True)
    moved.register_comm_hook(state, cgx.cgx_hook)
    train(moved, model, rank, 2, start=3, opt=opt)
    straight = flat_params(model)

    model, ddp, state, opt = setup(1)
    buf.seek(0)
    saved = torch.load(buf)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["cgx"])  # before the state knows its model: checked on first use
    train(ddp, model, rank, 2, start=3, opt=opt)
    return torch.equal(straight, flat_params(model)), sorted(saved["cgx"]["residuals"])


@pytest.mark.parametrize("two_level", [True, False])
def test_torch_cgx_form_resumes_onto_the_same_parameters_whatever_the_buckets(two_level):
    for same, residuals in values(run_ranks(_resume_with_other_buckets, 2, args=(two_level,))):
        assert same
        assert residuals == ["embed.weight", "head.weight", "hidden.weight"]


class FourSquare(torch.nn.Module):
    """Four weights of one shape: a residual put on the wrong one would fit it."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else torch.relu(x))
        return x


def _both_forms_resume_alike(rank, world):
    """torch_cgx's form and the model form with the same settings (2 bits: two-level
    feedback by default), find_unused_parameters: 3 steps in one DDP bucket
    (bucket_cap_mb=25), a checkpoint, then 2 more steps three ways: on in memory, resumed
    at bucket_cap_mb=25, resumed at bucket_cap_mb=0.005 (two weights a bucket)."""
    import cgx

    # The group says 4 bits (no feedback by default): each form must say 2 itself.
    init_cgx(rank, world, pg_options=cgx.Config(bits=4, compression_auto=False))
    forms = {
        "torch_cgx": lambda model: cgx.CGXState(dist.group.WORLD, layer_min_size=1024,
                                                compression_params={"bits": 2, "bucket_size": 256}),
        "model": lambda model: cgx.CGXState(None, model, cgx.CompressionPolicy(
            bits=2, bucket_size=256, minimal_size=1023)),
    }
    out = {}
    for form, state_of in forms.items():
        def setup(cap_mb, saved=None):
            torch.manual_seed(0)
            model = FourSquare()
            ddp = DDP(model, bucket_cap_mb=cap_mb, find_unused_parameters=True)
            state = state_of(model)
            ddp.register_comm_hook(state, cgx.cgx_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            if saved:
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                state.load_state_dict(saved["cgx"])
            return model, ddp, state, opt

        model, ddp, state, opt = setup(25)
        train(ddp, model, rank, 3, opt=opt)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cgx": state.state_dict()}, buf)
        train(ddp, model, rank, 2, start=3, opt=opt)
        runs = {"on": flat_params(model)}
        for cap_mb in (25, 0.005):
            buf.seek(0)
            resumed, ddp, _, opt = setup(cap_mb, torch.load(buf))
            train(ddp, resumed, rank, 2, start=3, opt=opt)
            runs[cap_mb] = flat_params(resumed)
        buf.seek(0)
        out[form] = {
            "runs": runs,
            "settings": dict(state.layer_settings),
            "fed back": sorted(n for n, s in state.layer_settings.items() if state.feeds_back(s)),
            "saved residuals": torch.load(buf)["cgx"]["residuals"],
        }
    return out


def test_both_forms_resume_alike_also_at_another_bucket_layout():
    """The no-model form resumes as the model form does, bit for bit, given the same
    settings. Two-level feedback's owner residuals follow DDP's bucket layout (the owner
    of a chunk adds its own contribution unquantized), so in either form a resume at
    another bucket_cap_mb takes a (slightly) different step than the run that went on,
    while a resume in the same layout takes the same (docs/hooks.md, checkpoints)."""
    import cgx

    for out in values(run_ranks(_both_forms_resume_alike, 2)):
        a, b = out["torch_cgx"], out["model"]
        assert a["settings"] == b["settings"]
        assert set(a["settings"].values()) == {cgx.LayerSetting(2, 256, "hadamard")}
        assert a["fed back"] == b["fed back"] == [f"layers.{i}.weight" for i in range(4)]
        assert sorted(a["saved residuals"]) == sorted(b["saved residuals"]) == a["fed back"]
        for name, residual in a["saved residuals"].items():
            assert torch.equal(residual, b["saved residuals"][name]), name
        for run in ("on", 25, 0.005):
            assert torch.equal(a["runs"][run], b["runs"][run]), run  # the forms agree
        for form in (a, b):
            assert torch.equal(form["runs"][25], form["runs"]["on"])  # same layout: exact
            # Another layout moves the owners: the same total, rounded otherwise. (Should
            # this become exact, docs/hooks.md and docs/error-feedback.md need updating.)
            assert not torch.equal(form["runs"][0.005], form["runs"]["on"])


class ReplayedBucket:
    """What DDP hands a comm hook (flat buffer, gradient views into it, parameters), with
    the index and is_last we choose: here those static_graph's first iteration gave where
    the issue was seen (every bucket index 0, none last). torch 2.13 gives one bucket."""

    def __init__(self, params, index, last):
        self._params, self._index, self._last = params, index, last
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])
        self._grads = list(torch.split(self._buffer, [p.numel() for p in params]))

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads

    def buffer(self):
        return self._buffer


def _replayed_static_graph(rank, world):
    import cgx

    init_cgx(rank, world)
    model = make_model()
    ddp = DDP(model)  # noqa: F841  (the state finds its module)
    state = cgx.CGXState(None, layer_min_size=1024, compression_params={"bits": 4}, warmup_steps=1)
    params = list(model.parameters())[::-1]
    buckets = [params[:3], params[3:6], params[6:]]
    steps, ratios, results = [], [], []
    for iteration in range(3):
        g = torch.Generator().manual_seed(10 * iteration + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        for i, members in enumerate(buckets):
            first = iteration == 0
            results.append(cgx.cgx_hook(state, ReplayedBucket(members, 0 if first else i,
                                                              not first and i == 2)).wait())
            steps.append(state.step)
        ratios.append(state.stats()["compression_ratio"])
    everyone = [None] * world
    dist.all_gather_object(everyone, [r.tolist() for r in results])
    names = {n for n, _ in model.named_parameters()}
    return (steps, ratios, set(state.layer_settings) == names, set(state.residuals) <= names,
            all(e == everyone[0] for e in everyone))


def test_layers_and_steps_do_not_depend_on_ddps_bucket_numbering():
    """Layers are named by parameter, and a step that DDP never called last ends where its
    parameters come round again: warm-up covers exactly the first step."""
    for steps, ratios, named, residuals_named, identical in values(run_ranks(_replayed_static_graph, 2)):
        assert steps == [0, 0, 0, 1, 1, 2, 2, 2, 3]
        assert ratios[0] == 1.0 and ratios[1] > 1.5  # step 0 raw (warm-up), step 1 compressed
        assert named and residuals_named and identical


def _state_before_init(rank, world):
    """Lightning's DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...) builds the state
    before the processes start and init_process_group runs: the group and its defaults are
    read on the hook's first call, with the same training as a state made after init."""
    import cgx

    early = {
        "torch_cgx": cgx.CGXState(None, compression_params={"bits": 4, "bucket_size": 256}),
        "group defaults": cgx.CGXState(None),
    }
    init_cgx(rank, world, pg_options=cgx.Config(bits=2, bucket_size=128, minimal_size=100, compression_auto=False))
    late = {
        "torch_cgx": lambda: cgx.CGXState(None, compression_params={"bits": 4, "bucket_size": 256}),
        "group defaults": lambda: cgx.CGXState(None),
    }
    out = {}
    for name, state in early.items():
        runs = []
        for made in (state, late[name]()):
            model = make_model()
            ddp = DDP(model)
            ddp.register_comm_hook(made, cgx.cgx_hook)
            _, same = train(ddp, model, rank, 3, check_every_step=True)
            runs.append((flat_params(model), made.policy, same))
        out[name] = (torch.equal(runs[0][0], runs[1][0]) and runs[0][2],
                     (runs[0][1].bits, runs[0][1].bucket_size, runs[0][1].minimal_size))
    return out


def test_state_made_before_the_process_group():
    for out in values(run_ranks(_state_before_init, 2)):
        assert out["torch_cgx"] == (True, (4, 256, 1023))
        assert out["group defaults"] == (True, (2, 128, 100))


class SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(1000, 32, sparse=True)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, idx):
        return self.head(self.embed(idx).mean(1))


def _sparse_embedding(rank, world, hooked):
    """DDP with nn.Embedding(sparse=True): on an exact cgx group every step equals the
    same DDP on Gloo, bit for bit; on a compressing group the sparse gradient is still
    Gloo's exactly, and replicas stay identical."""
    import cgx
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    init_cgx(rank, world, pg_options=cgx.Config(bits=4, compression_auto=False))
    gloo = dist.new_group(backend="gloo")
    exact = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=32))

    def ddp_on(group, policy=None):
        model = SparseNet()
        ddp = DDP(model, process_group=group)
        if hooked and group is gloo:
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)  # divides first, like cgx's
        elif hooked:
            ddp.register_comm_hook(cgx.CGXState(group, model, policy), cgx.cgx_hook)
        return model, ddp

    def step(model, ddp, opt, i):
        g = torch.Generator().manual_seed(100 * i + rank)
        idx, y = torch.randint(0, 1000, (8, 5), generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(idx), y).backward()
        opt.step()
        return model.embed.weight.grad.to_dense()

    out = {}
    runs = {}
    for name, group, policy in (("gloo", gloo, None), ("exact cgx", exact, cgx.CompressionPolicy(bits=32)),
                                ("compressing cgx", dist.group.WORLD, cgx.CompressionPolicy(bits=4, minimal_size=0))):
        model, ddp = ddp_on(group, policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        grads = [step(model, ddp, opt, i) for i in range(4)]
        runs[name] = (grads, flat_params(model))
    out["exact cgx equals gloo"] = (all(map(torch.equal, runs["gloo"][0], runs["exact cgx"][0]))
                                    and torch.equal(runs["gloo"][1], runs["exact cgx"][1]))
    # Step 0's sparse gradient is exact also where the dense layers are compressed.
    out["sparse gradient exact when compressing"] = torch.equal(runs["gloo"][0][0], runs["compressing cgx"][0][0])
    compressed = runs["compressing cgx"][1]
    everyone = [torch.empty_like(compressed) for _ in range(world)]
    dist.all_gather(everyone, compressed, group=gloo)
    out["replicas identical"] = all(torch.equal(everyone[0], e) for e in everyone)
    out["dense layers compressed"] = not torch.equal(compressed, runs["gloo"][1])
    return out


@pytest.mark.parametrize("hooked", [False, True])
def test_ddp_sparse_embedding(hooked):
    for out in values(run_ranks(_sparse_embedding, 2, args=(hooked,))):
        failed = [name for name, ok in out.items() if not ok]
        assert not failed, failed


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
    with pytest.raises(ValueError, match="module_type .* matches no module"):
        cgx.CGXState(None, make_model(), cgx.CompressionPolicy(rules=[cgx.LayerRule(module_type=torch.nn.Conv2d)]))
    # Rules whose criteria each match something, but never together; a size no layer has.
    with pytest.raises(ValueError, match="criteria never hold together"):
        cgx.CGXState(None, make_model(), cgx.CompressionPolicy(
            rules=[cgx.LayerRule(pattern="embed.*", module_type=torch.nn.LayerNorm)]))
    with pytest.raises(ValueError, match="none has at most 2 elements"):
        cgx.CGXState(None, make_model(), cgx.CompressionPolicy(rules=[cgx.LayerRule(max_numel=2)]))
    # torch_cgx's form: keywords only, its two parameters, and no rules that need a model.
    with pytest.raises(TypeError, match="layer_min_size goes by keyword"):
        cgx.CGXState(None, 1024)
    with pytest.raises(ValueError, match="unknown compression_params \\['bit'\\]"):
        cgx.CGXState(None, compression_params={"bit": 4})
    with pytest.raises(ValueError, match="either policy or torch_cgx's"):
        cgx.CGXState(None, None, cgx.CompressionPolicy(), layer_min_size=10)
    with pytest.raises(ValueError, match="compression_params: bits must be in 1..8"):
        cgx.CGXState(None, compression_params={"bits": 0})
    # Without a process group yet (a state made before init_process_group): what needs the
    # group says so; the rest waits for the first call.
    with pytest.raises(RuntimeError, match="default process group does not exist yet"):
        cgx.CGXState(None, compression_params={"bits": 4}).group()
    with pytest.raises(RuntimeError, match="default process group does not exist yet"):
        cgx.get_backend()


def test_load_state_dict_validates_and_names_the_key():
    import cgx

    def state():
        return cgx.CGXState(None, make_model(), cgx.CompressionPolicy(bits=4))

    good = state().state_dict()
    good["residuals"] = {"hidden.weight": torch.zeros(128 * 128)}
    state().load_state_dict(good)  # accepted
    bad = {
        "{}": ({}, "missing \\['rank', 'world_size', 'step'"),
        "bits 0": ({**good, "layer_settings": {"hidden.weight": (0, 512)}},
                   "layer_settings\\['hidden.weight'\\]: bits must be in 1..8, or 32"),
        "bits 9": ({**good, "layer_settings": {"hidden.weight": (9, 512)}}, "bits must be in"),
        "bits a string": ({**good, "layer_settings": {"hidden.weight": ("4", 512)}}, "bits must be in"),
        "bucket size": ({**good, "layer_settings": {"hidden.weight": (4, 0)}}, "bucket_size must be in"),
        "residual shape": ({**good, "residuals": {"hidden.weight": torch.zeros(7)}},
                           "residuals\\['hidden.weight'\\] has 7 values, the layer 16384"),
        "residual type": ({**good, "residuals": {"hidden.weight": [0.0]}}, "must be a float tensor"),
        "unknown layer": ({**good, "residuals": {"bucket0.1": torch.zeros(128)}},
                          "names layers the model does not have \\(\\['bucket0.1'\\]"),
        "step": ({**good, "step": -1}, "'step' must be an integer >= 0"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            state().load_state_dict(value)
    with pytest.raises(TypeError, match="expected the dict of CGXState.state_dict"):
        state().load_state_dict([])


def _state_of_another_model(rank, world):
    import cgx

    init_cgx(rank, world)
    model = make_model()
    ddp = DDP(model)
    ddp.register_comm_hook(cgx.CGXState(None, make_model(), cgx.CompressionPolicy(bits=4)), cgx.cgx_hook)
    try:
        train(ddp, model, rank, 1)
        return "no error"
    except Exception as e:  # DDP may wrap it
        return str(e)


def test_state_built_on_another_model_names_the_problem():
    for message in values(run_ranks(_state_of_another_model, 2)):
        assert "not in the model the CGXState was built on" in message, message


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
    # The default scheme, hadamard, where it takes the bits (1..4); maxmin above.
    assert settings["norm.weight"] == cgx.LayerSetting(8, 512, "maxmin")  # first match wins over 1-D default
    assert settings["head.weight"] == cgx.LayerSetting(6, 64, "maxmin")
    assert settings["embed.weight"] == cgx.LayerSetting(2, 512, "hadamard")  # 4096 elements
    assert settings["hidden.weight"] == cgx.LayerSetting(4, 512, "hadamard")  # default
    assert settings["hidden.bias"] == cgx.LayerSetting(32, 512)  # 1-D: raw by default
    assert settings["embed.bias"] == cgx.LayerSetting(2, 512, "hadamard")  # a rule beats the 1-D default
    assert cgx.LayerRule(max_numel=100, bits=2).matches("x", torch.nn.Linear(1, 1), 101) is False


def _feedback_by_bits(rank, world):
    """Which layers keep a residual: by default those at 2 bits or fewer (also after an
    adaptive plan moves a layer across), or every compressed one, or none."""
    import cgx

    init_cgx(rank, world)
    out = {}
    rules = [cgx.LayerRule(pattern="hidden.weight", bits=2), cgx.LayerRule(pattern="head.weight", bits=3)]
    for form, feedback, two_level in (("default", None, True), ("default one-level", None, False),
                                      ("all", True, True), ("none", False, True)):
        model = make_model()
        ddp = DDP(model)
        state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4, rules=rules),
                             error_feedback=feedback, two_level=two_level)
        ddp.register_comm_hook(state, cgx.cgx_hook)
        train(ddp, model, rank, 2)
        out[form] = sorted(n for n, r in state.residuals.items() if r.ne(0).any())
        if form == "default":
            # A plan that moves the 2-bit layer to 4 bits drops its residual at the next step.
            state.set_layer_settings({"hidden.weight": cgx.LayerSetting(4, 512)})
            train(ddp, model, rank, 1, start=2)
            out["moved above"] = sorted(state.residuals)
    try:
        cgx.CGXState(None, make_model(), error_feedback="yes")
    except TypeError as e:
        out["bad value"] = str(e)
    return out


def test_error_feedback_by_default_only_at_two_bits_or_fewer():
    for out in values(run_ranks(_feedback_by_bits, 2)):
        assert out["default"] == out["default one-level"] == ["hidden.weight"], out
        assert out["all"] == ["embed.weight", "head.weight", "hidden.weight"], out
        assert out["none"] == [], out
        assert out["moved above"] == [], out
        assert "error_feedback must be True, False or None" in out["bad value"], out
