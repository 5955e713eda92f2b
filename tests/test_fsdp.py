"""FSDP2 on cgx: exact as Gloo when nothing is compressed; the compressed all-gather and
reduce-scatter (ProcessGroupCGX.allgather_layout / reduce_scatter_layout) and cgx.qsdp
on a small transformer, on real ranks (world sizes 2, 3, 4)."""

from __future__ import annotations

import pytest
import torch

from harness import init_cgx, load_everyones_state, run_ranks, values

# One shard's plan: raw runs, 4- and 8-bit layers, a layer shorter than its bucket.
SHARD = 1000
PLAN = [(0, 37, 32, 1), (37, 500, 4, 128), (537, 63, 32, 1), (600, 390, 8, 64), (990, 10, 2, 512)]


def step_bound(x: torch.Tensor, bits: int, bucket: int, stochastic: bool) -> torch.Tensor:
    """Per element: one quantization step of its bucket (half of one for round-to-nearest),
    plus float32 decode rounding."""
    x = x.double()
    bound = torch.empty_like(x)
    for start in range(0, x.numel(), bucket):
        b = x[start:start + bucket]
        step = float(b.max() - b.min()) / (2**bits - 1)
        bound[start:start + bucket] = step * (1.0 if stochastic else 0.5) + 4 * 2.0**-24 * float(b.abs().max())
    return bound


def check_within_plan(original: torch.Tensor, decoded: torch.Tensor, stochastic: bool) -> None:
    """Raw segments exact, compressed ones within the step bound of their buckets."""
    for offset, numel, bits, bucket in PLAN:
        x, y = original[offset:offset + numel], decoded[offset:offset + numel]
        if bits == 32:
            assert torch.equal(x, y), (offset, numel)
        else:
            err = (y.double() - x.double()).abs()
            assert bool((err <= step_bound(x, bits, bucket, stochastic)).all()), (offset, float(err.max()))


def reference_decode(x: torch.Tensor) -> torch.Tensor:
    """What one quantization of `x` as PLAN says decodes to (round-to-nearest)."""
    import cgx

    out = x.clone().float()
    for offset, numel, bits, bucket in PLAN:
        if bits != 32:
            piece = out[offset:offset + numel]
            piece.copy_(cgx.decompress(cgx.compress(piece, bits, bucket), numel, bits, bucket))
    return out


# ---- the collectives


def _allgather(rank, world, dtype, stochastic, seeds, plan=PLAN):
    import cgx

    init_cgx(rank, world)
    backend = cgx.get_backend()
    g = torch.Generator().manual_seed(rank)
    shard = (torch.randn(SHARD, generator=g) * (rank + 1)).to(dtype)
    outs = []
    for seed in seeds:
        out = torch.empty(SHARD * world, dtype=dtype)
        own = out.narrow(0, rank * SHARD, SHARD)
        own.copy_(shard)
        # FSDP2's form: the input is the output's own slice.
        backend.allgather_layout(out, own, plan, stochastic=stochastic, seed=seed).wait()
        outs.append(out)
    return shard, outs, cgx.stats()["allgather"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_compressed_allgather_identical_and_within_half_a_step(world):
    results = values(run_ranks(_allgather, world, args=(torch.float32, False, [0])))
    shards = [r[0] for r in results]
    out = results[0][1][0]
    for r in results[1:]:
        assert torch.equal(r[1][0], out), "ranks decoded different weights"
    for owner, shard in enumerate(shards):
        got = out[owner * SHARD:(owner + 1) * SHARD]
        check_within_plan(shard, got, stochastic=False)
        # Round-to-nearest is deterministic: exactly what the codec makes of the shard.
        assert torch.equal(got, reference_decode(shard))
    stats = results[0][2]
    assert stats["calls"] == 1
    # Every peer gets this rank's shard: 4-bit and 8-bit layers, raw 1-D ones.
    assert stats["uncompressed_bytes"] == 4 * SHARD * (world - 1)
    assert stats["bytes_sent"] * 2.5 < stats["uncompressed_bytes"]


# qsdp's -hadamard policy: hadamard segments (a shorter last bucket in the second) beside
# a raw one and a maxmin one too wide for hadamard.
HADAMARD_PLAN = [(0, 512, 4, 128, "hadamard"), (512, 300, 2, 256, "hadamard"), (812, 37, 32, 1), (849, 151, 8, 64)]


def test_compressed_allgather_of_hadamard_weights_is_identical_and_the_codec_s():
    import cgx

    results = values(run_ranks(_allgather, 3, args=(torch.float32, False, [0], HADAMARD_PLAN)))
    out = results[0][1][0]
    assert all(torch.equal(r[1][0], out) for r in results[1:]), "ranks decoded different weights"
    for owner, (shard, _, _) in enumerate(results):
        got = out[owner * SHARD:(owner + 1) * SHARD]
        for offset, numel, bits, bucket, *scheme in HADAMARD_PLAN:
            piece = shard[offset:offset + numel]
            want = piece if bits == 32 else cgx.decompress(
                cgx.compress(piece, bits, bucket, scheme=scheme[0] if scheme else "maxmin"), numel, bits, bucket,
                scheme=scheme[0] if scheme else "maxmin")
            assert torch.equal(got[offset:offset + numel], want), (owner, offset)


def test_compressed_allgather_bfloat16():
    results = values(run_ranks(_allgather, 2, args=(torch.bfloat16, False, [0])))
    out = results[0][1][0]
    assert out.dtype == torch.bfloat16 and torch.equal(results[1][1][0], out)
    for owner, (shard, _, _) in enumerate(results):
        got = out[owner * SHARD:(owner + 1) * SHARD]
        assert torch.equal(got, reference_decode(shard).to(torch.bfloat16))


def test_stochastic_allgather_unbiased_and_seeded():
    seeds = list(range(200)) + [7]
    results = values(run_ranks(_allgather, 2, args=(torch.float32, True, seeds)))
    for owner, (shard, outs, _) in enumerate(results):
        mine = [o[owner * SHARD:(owner + 1) * SHARD] for o in outs]
        for got in mine:
            check_within_plan(shard, got, stochastic=True)
        # The same seed gives the same bytes (a backward re-gather of one step), another
        # seed other roundings.
        assert torch.equal(mine[7], mine[-1]) and not torch.equal(mine[0], mine[1])
        for other, (_, their_outs, _) in enumerate(results):
            assert torch.equal(their_outs[3], outs[3]), (owner, other)
        # Unbiased: the mean over 200 seeds is within 4 standard errors of the value,
        # where one rounding is off by up to a whole step.
        mean = torch.stack(mine[:200]).double().mean(0)
        for offset, numel, bits, bucket in PLAN:
            if bits == 32:
                continue
            x = shard[offset:offset + numel]
            step = step_bound(x, bits, bucket, stochastic=True)
            err = (mean[offset:offset + numel] - x.double()).abs()
            assert bool((err <= 4 * 0.5 * step / 200**0.5 + 1e-6).all()), (offset, float((err / step).max()))


def _reduce_scatter(rank, world, dtype, op, factor, steps):
    import cgx

    init_cgx(rank, world)
    backend = cgx.get_backend()
    residual = torch.zeros(SHARD * world) if steps > 1 else None
    inputs, outs, residuals = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = (torch.randn(SHARD * world, generator=g) * (rank + 1)).to(dtype)
        before = x.clone()
        out = torch.empty(SHARD, dtype=dtype)
        backend.reduce_scatter_layout(out, x, PLAN, op=op, factor=factor, residual=residual).wait()
        assert torch.equal(x, before), "the input was changed"
        inputs.append(x)
        outs.append(out)
        residuals.append(None if residual is None else residual.clone())
    return inputs, outs, residuals, cgx.stats()["reduce_scatter"]


@pytest.mark.parametrize("world,op,dtype", [
    (2, "avg", torch.float32), (3, "sum", torch.float32), (4, "premul_sum", torch.float32),
    (3, "avg", torch.bfloat16),
])
def test_compressed_reduce_scatter(world, op, dtype):
    factor = 0.125
    results = values(run_ranks(_reduce_scatter, world, args=(dtype, op, factor, 1)))
    for owner, (_, outs, _, stats) in enumerate(results):
        contributions = [r[0][0][owner * SHARD:(owner + 1) * SHARD] for r in results]
        # Exactly: each contribution decoded, summed in float32 in rank order, then scaled.
        total = torch.zeros(SHARD)
        for c in contributions:
            total += reference_decode(c)
        total = total / world if op == "avg" else total * factor if op == "premul_sum" else total
        assert torch.equal(outs[0], total.to(dtype)), owner
        # And within one stage per contribution of the exact sum.
        exact = torch.stack([c.double() for c in contributions]).sum(0)
        scale = 1 / world if op == "avg" else factor if op == "premul_sum" else 1.0
        for offset, numel, bits, bucket in PLAN:
            sl = slice(offset, offset + numel)
            if bits == 32:
                bound = torch.zeros(numel, dtype=torch.float64)
            else:
                bound = sum(step_bound(c[sl], bits, bucket, False) for c in contributions)
            bound = bound * scale + 8 * 2.0**-24 * float(exact[sl].abs().max()) * scale
            if dtype != torch.float32:
                bound = bound + 2.0**-8 * outs[0][sl].double().abs()
            err = (outs[0][sl].double() - exact[sl] * scale).abs()
            assert bool((err <= bound).all()), (owner, offset, float(err.max()))
        # Raw layers travel as float32: against bfloat16 the ratio halves.
        ratio = 2.5 if dtype == torch.float32 else 1.25
        assert stats["calls"] == 1 and stats["bytes_sent"] * ratio < stats["uncompressed_bytes"]


def test_reduce_scatter_error_feedback_keeps_what_quantization_lost():
    results = values(run_ranks(_reduce_scatter, 2, args=(torch.float32, "avg", 1.0, 3)))
    for rank, (inputs, _, residuals, _) in enumerate(results):
        carried = torch.zeros(SHARD * 2)
        for x, residual in zip(inputs, residuals):
            target = x + carried
            # The owner's own shard joins its sum as it is: nothing lost there.
            sent = torch.cat([target[r * SHARD:(r + 1) * SHARD] if r == rank
                              else reference_decode(target[r * SHARD:(r + 1) * SHARD]) for r in range(2)])
            assert torch.equal(residual, target - sent)
            assert bool(residual[rank * SHARD:(rank + 1) * SHARD].eq(0).all())
            carried = residual
        # Bounded, not growing: at most half a step of each bucket of the last target.
        assert float(carried.abs().max()) < float(target.abs().max())


def _mismatch(rank, world, what):
    import cgx

    init_cgx(rank, world)
    backend = cgx.get_backend()
    plan = PLAN if rank == 0 or what != "plan" else [(0, SHARD, 4, 128)]
    shard = SHARD if rank == 0 or what != "size" else SHARD + 8
    out = torch.empty(shard * world)
    try:
        if what == "factor":  # a PREMUL_SUM factor the ranks disagree on
            x = torch.ones(SHARD * world)
            backend.reduce_scatter_layout(torch.empty(SHARD), x, PLAN, op="premul_sum",
                                          factor=0.5 if rank == 1 else 0.25).wait()
        else:
            backend.allgather_layout(out, out.narrow(0, rank * shard, shard),
                                     plan if shard == SHARD else [(0, shard, 4, 128)]).wait()
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    # The group stays usable after a mismatch: the next call is right.
    x = torch.full((SHARD * world,), float(rank + 1))
    y = torch.empty(SHARD)
    backend.reduce_scatter_layout(y, x, [(0, SHARD, 32, 1)], op="sum").wait()
    return outcome, float(y[0])


@pytest.mark.parametrize("what", ["plan", "size", "factor"])
def test_mismatched_buffers_raise_on_every_rank(what):
    results = values(run_ranks(_mismatch, 3, args=(what,)))
    for message, after in results:
        assert "ranks were given different calls" in message, message
        assert {"plan": "per-layer plan", "size": "elements", "factor": "scale 0.25"}[what] in message, message
        assert after == 6.0


def _bad_calls(rank, world):
    import cgx

    init_cgx(rank, world)
    backend = cgx.get_backend()
    out, inp = torch.empty(2 * SHARD), torch.empty(SHARD)
    errors = {}
    for name, call in {
        "wrong size": lambda: backend.allgather_layout(torch.empty(3 * SHARD), inp, PLAN),
        "short plan": lambda: backend.allgather_layout(out, inp, PLAN[:2]),
        "int tensor": lambda: backend.allgather_layout(out.int(), inp.int(), PLAN),
        "bad op": lambda: backend.reduce_scatter_layout(inp, out, PLAN, op="max"),
        "bad residual": lambda: backend.reduce_scatter_layout(inp, out, PLAN, residual=torch.zeros(3)),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    return errors


def test_bad_sharded_calls_raise_before_anything_moves():
    errors = values(run_ranks(_bad_calls, 2))[0]
    assert "expected 2 shards" in errors["wrong size"]
    assert "layout covers" in errors["short plan"]
    assert "expected float32" in errors["int tensor"]
    assert "'sum', 'avg' or 'premul_sum'" in errors["bad op"]
    assert "residual must be" in errors["bad residual"]


# ---- FSDP2


def _model(seed: int, dim: int = 26, vocab: int = 50):
    """A small transformer; dims not divisible by 3 or 4, so shards are padded."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

        def forward(self, x):
            h = self.norm(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(x)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    return Tiny()


def _shard(model, mesh, **kwargs):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def _train(model, rank, steps, vocab=50, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, vocab, (4, 12), generator=g)
        y = (x * 7 + 3) % vocab  # a learnable map
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _full_params(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def _fsdp_plain(rank, world, backend):
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if backend == "cgx":
        init_cgx(rank, world)
    else:
        dist.init_process_group("gloo", init_method=os.environ["CGX_TEST_INIT_METHOD"], rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    _train(model, rank, 4)
    return _full_params(model)


def test_fsdp_uncompressed_is_bit_identical_to_gloo():
    ours = values(run_ranks(_fsdp_plain, 2, args=("cgx",), env={"CGX_COMPRESSION_QUANTIZATION_BITS": "4"}))
    gloo = values(run_ranks(_fsdp_plain, 2, args=("gloo",)))
    # A group that compresses allreduces leaves FSDP2's all-gather and reduce-scatter
    # exact unless cgx.qsdp asks.
    for name, value in gloo[0].items():
        assert torch.equal(ours[0][name], value), name
        assert torch.equal(ours[1][name], value), name


def _qsdp_on_an_unchecked_torch(rank, world, what):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    import cgx
    import cgx.fsdp2_access

    init_cgx(rank, world)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    get_state = FSDPModule._get_fsdp_state
    if what == "release":
        cgx.fsdp2_access.CHECKED_TORCH = ((1, 0),)  # as if this torch were newer than any checked
    else:  # a checked release whose internals moved: the accessor is gone while qsdp looks
        del FSDPModule._get_fsdp_state
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = cgx.qsdp(model, weight_bits=4, grad_bits=4)
    finally:
        FSDPModule._get_fsdp_state = get_state
    _train(model, rank, 4)
    return _full_params(model), [str(w.message) for w in caught], handle.stats()


@pytest.mark.parametrize("what, reason", [
    ("release", f"torch {torch.__version__} is not among the releases cgx's FSDP2 adapter was checked against (1.0)"),
    ("internals", f"FSDP2's internals on torch {torch.__version__} are not what cgx reads"),
])
def test_qsdp_on_a_torch_outside_the_checked_range_stays_exact_and_says_why(what, reason):
    results = values(run_ranks(_qsdp_on_an_unchecked_torch, 2, args=(what,)))
    gloo = values(run_ranks(_fsdp_plain, 2, args=("gloo",)))
    for params, warned, stats in results:
        for name, value in gloo[0].items():
            assert torch.equal(params[name], value), name  # exact: Gloo's bits
        assert any(reason in w for w in warned), warned
        assert reason in stats["unsupported"], stats["unsupported"]
        assert set(stats["exact_units"]["allgather"]) == {"<root>", "blocks.0", "blocks.1"}
        assert stats["allgather"]["calls"] == 0 and stats["reduce_scatter"]["calls"] == 0


class _Recording:
    """Wraps a unit's all-gather comm and keeps (input, output) of every call."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        given = input_tensor.clone()
        self.inner(output_tensor, input_tensor, group, async_op=False)
        self.log.append((given, output_tensor.clone()))


def _record_all_gathers(unit_module, log):
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    inner = unit_module._get_fsdp_state()._fsdp_param_group._all_gather_comm
    unit_module.set_custom_all_gather(type("RecordingAllGather", (_Recording, AllGather), {})(inner, log))


def _by_input(log):
    """The outputs of the gathers in `log`, grouped by the exact bytes of their input."""
    groups: dict = {}
    for given, out in log:
        groups.setdefault(given.numpy().tobytes(), []).append(out)
    return groups


def _qsdp(rank, world, weight_bits, grad_bits, rounding, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    handle = cgx.qsdp(model, weight_bits=weight_bits, grad_bits=grad_bits, weight_rounding=rounding)
    log: list = []
    _record_all_gathers(model.blocks[0], log)
    losses = _train(model, rank, steps)
    full = _full_params(model)
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    plan = handle.units[1].plans["allgather"]
    dist.barrier()
    return rank, losses, log, full, local, state, plan, handle.stats()


@pytest.mark.parametrize("world,rounding", [(2, "stochastic"), (3, "nearest")])
def test_qsdp_trains_with_exact_and_bounded_layers(world, rounding):
    results = values(run_ranks(_qsdp, world, args=(8, 8, rounding, 12), timeout_s=240))
    losses = results[0][1]
    assert losses[-1] < 0.8 * losses[0], losses
    log0, full0 = results[0][2], results[0][3]
    for rank, _, log, full, local, state, plan, stats in results:
        # Replicas gather bit-identical weights, in forward and again in backward.
        assert len(log) == len(log0)
        for call, ((_, out), (_, out0)) in enumerate(zip(log, log0)):
            assert torch.equal(out, out0), call
        for given, out in log:
            shard = given.numel()
            own = out[rank * shard:(rank + 1) * shard]
            for offset, numel, bits, bucket, _ in plan:  # raw layers exact, the others in bound
                x, y = given[offset:offset + numel], own[offset:offset + numel]
                if bits == 32:
                    assert torch.equal(x, y)
                else:
                    err = (y.double() - x.double()).abs()
                    assert bool((err <= step_bound(x, bits, bucket, rounding == "stochastic")).all())
        assert all(len(outs) == 2 and torch.equal(outs[0], outs[1]) for outs in _by_input(log).values()), \
            "the backward re-gather must give the forward's weights"
        # full_tensor() and state_dict() are exact: each rank's rows are its shard, unquantized.
        for name, value in full.items():
            assert torch.equal(value, full0[name]), name
            assert torch.equal(state[name], value), name
            rows = -(-value.shape[0] // world)
            assert torch.equal(value[rank * rows:rank * rows + local[name].shape[0]], local[name]), name
        for kind in ("allgather", "reduce_scatter"):
            assert stats[kind]["calls"] > 0 and stats[kind]["exact_calls"] == 0
            assert stats[kind]["bytes_sent"] * 3 < stats[kind]["uncompressed_bytes"], (kind, stats)


def _mixed_dtypes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    model.blocks[1].norm.to(torch.bfloat16).requires_grad_(False)  # gathered with float32: as uint8
    model.blocks[1].norm.forward = lambda x, norm=model.blocks[1].norm: torch.nn.functional.layer_norm(
        x, norm.normalized_shape, norm.weight.float(), norm.bias.float())
    _shard(model, init_device_mesh("cpu", (world,)))
    handle = cgx.qsdp(model, weight_bits=4, grad_bits=8)
    losses = _train(model, rank, 3)
    return losses, handle.stats(), _full_params(model)


def test_unit_gathered_as_uint8_stays_exact_and_says_why():
    results = values(run_ranks(_mixed_dtypes, 2))
    losses, stats, _ = results[0]
    assert all(l == l for l in losses)
    reason = stats["exact_units"]["allgather"]["blocks.1"]
    assert "torch.uint8" in reason and "mixed" in reason
    assert stats["allgather"]["exact_calls"] > 0 and stats["allgather"]["calls"] > 0
    assert "blocks.0" not in stats["exact_units"]["allgather"]
    for name, value in results[0][2].items():
        assert torch.equal(results[1][2][name], value), name


def _hsdp(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(0)
    _shard(model, mesh)
    handle = cgx.qsdp(model, weight_bits=8, grad_bits=8)
    losses = _train(model, rank, 6)
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    replicate = cgx.stats(mesh.get_group("replicate"))
    dist.barrier()
    return losses, local, handle.stats(), replicate, mesh.get_coordinate()


def test_hsdp_two_by_two_compresses_both_and_keeps_replicas_identical():
    results = values(run_ranks(_hsdp, 4, env={"CGX_COMPRESSION_QUANTIZATION_BITS": "8"}, timeout_s=240))
    by_shard: dict = {}
    for losses, local, stats, replicate, coordinate in results:
        assert losses[-1] < losses[0], losses
        assert stats["allgather"]["calls"] > 0 and stats["reduce_scatter"]["calls"] > 0
        # The replicate all-reduce is a compressed allreduce of the replicate group.
        assert replicate["calls"] > 0 and replicate["bytes_sent"] * 3 < replicate["uncompressed_bytes"]
        by_shard.setdefault(coordinate[1], []).append(local)
    for shard, (a, b) in by_shard.items():
        for name in a:
            assert torch.equal(a[name], b[name]), (shard, name)


def _checkpoints_across_meshes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:  # shard groups of 2 ranks, each rank of them twice
        fully_shard(block, mesh=hsdp)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # and one of all 4
    handle = cgx.qsdp(model, weight_bits=8, grad_bits=4, error_feedback=True)
    _train(model, rank, 1)
    return load_everyones_state(handle.state_dict, handle.load_state_dict)


def test_qsdp_checkpoint_loads_on_its_own_rank_only_whatever_groups_the_units_shard_over():
    # Under HSDP two replicas hold the same rank of their shard groups, with different
    # residuals: a state names its global rank, and only that rank loads it.
    for rank, outcome in enumerate(values(run_ranks(_checkpoints_across_meshes, 4, timeout_s=240))):
        assert outcome[rank] == "loaded", outcome
        for saver in set(outcome) - {rank}:
            assert f"(global rank {saver})" in outcome[saver] and "must save and load its own" in outcome[saver]


def _bad_qsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    errors = {}
    model = _model(0)
    for name, call in {
        "weight_bits": lambda: cgx.qsdp(model, weight_bits=9),
        "grad_bits": lambda: cgx.qsdp(model, grad_bits=True),
        "rounding": lambda: cgx.qsdp(model, weight_rounding="up"),
        "no unit": lambda: cgx.qsdp(model),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    _shard(model, init_device_mesh("cpu", (world,)))
    try:
        cgx.qsdp(model, policy=cgx.CompressionPolicy(rules=[cgx.LayerRule(pattern="nope.*")]))
    except ValueError as e:
        errors["rule"] = str(e)
    return errors


def test_qsdp_bad_arguments_raise_value_error_naming_them():
    for errors in values(run_ranks(_bad_qsdp, 2)):
        assert "weight_bits: bits must be in 1..8" in errors["weight_bits"]
        assert "grad_bits: bits must be in 1..8" in errors["grad_bits"]
        assert "weight_rounding" in errors["rounding"]
        assert "has no FSDP2 unit" in errors["no unit"]
        assert "matches no trainable parameter" in errors["rule"]


def _error_feedback(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    handle = cgx.qsdp(model, weight_bits=8, grad_bits=2, error_feedback=True)
    losses = _train(model, rank, 3)
    state = handle.state_dict()
    torch.save(state, f"{directory}/qsdp-{rank}.pt")
    sizes = {u.name: u.shard_numel * world for u in handle.units}
    handle.load_state_dict(state)
    refused = {}
    for name, bad in {
        "short residual": {**state, "residuals": {"blocks.0": torch.zeros(3)}},
        "other rank": {**state, "rank": (rank + 1) % world},
        "other world size": {**state, "world_size": 2 * world},
        "other layout": {**state, "layouts": {**state["layouts"], "blocks.0": [[0, 5, 2, 512]]}},
        "no unit": {**state, "residuals": {"blocks.7": torch.zeros(3)}},
        "not a state": {"residuals": {}},
    }.items():
        try:
            handle.load_state_dict(bad)
            refused[name] = None
        except ValueError as e:
            refused[name] = str(e)
    # Without residuals nothing in it depends on the rank or the world size.
    handle.load_state_dict({**state, "world_size": 2 * world, "rank": 5, "residuals": {}})
    return losses, state, sizes, refused


def test_qsdp_error_feedback_residuals_checkpoint(tmp_path):
    for losses, state, sizes, refused in values(run_ranks(_error_feedback, 2, args=(str(tmp_path),))):
        assert all(l == l for l in losses)
        assert set(state["residuals"]) == set(sizes) and state["world_size"] == 2
        for name, residual in state["residuals"].items():
            assert residual.numel() == sizes[name] and float(residual.abs().max()) > 0, name
        assert "has 3 elements" in refused["short residual"]
        assert "every rank must save and load its own" in refused["other rank"]
        assert "saved in a group of 4 ranks, loaded in one of 2" in refused["other world size"]
        assert "unit 'blocks.0' lays out its gradient shard otherwise" in refused["other layout"]
        assert "no unit named ['blocks.7']" in refused["no unit"]
        assert "missing ['rank', 'world_size', 'layouts']" in refused["not a state"]
    # The same files at 4 ranks (2 and 4 ranks pad the shards to one total size: only the
    # world size tells them apart) are refused, naming it.
    for message in values(run_ranks(_load_at_another_world_size, 4, args=(str(tmp_path),), timeout_s=240)):
        assert "saved in a group of 2 ranks, loaded in one of 4" in message, message


def _load_at_another_world_size(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    handle = cgx.qsdp(model, weight_bits=8, grad_bits=2, error_feedback=True)
    try:
        handle.load_state_dict(torch.load(f"{directory}/qsdp-{rank % 2}.pt"))
        return "accepted"
    except ValueError as e:
        return str(e)


def _loss_of(model, x, y, shape, vocab=50):
    """One step's loss, computed in the training-loop shape named."""
    from torch.utils.checkpoint import checkpoint

    def loss(inputs, targets):
        return torch.nn.functional.cross_entropy(model(inputs).reshape(-1, vocab), targets.reshape(-1))

    if shape == "two forwards":  # both graphs live until one backward
        return loss(x[:2], y[:2]) + loss(x[2:], y[2:])
    if shape == "root checkpoint":  # the recompute gathers every unit again in backward
        return checkpoint(loss, x, y, use_reentrant=False)
    return loss(x, y)


def _checkpoint_blocks(model, reentrant):
    """Activation checkpointing of each block, as a model's forward would call it."""
    from torch.utils.checkpoint import checkpoint

    def forward(x):
        x = model.embed(x)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        return model.head(model.norm(x))

    model.forward = forward


def _stochastic_weights_in_shapes(rank, world, shape):
    """Stochastic weight rounding, in each shape that gathers a unit more than once per
    set of weights: every gather of the same weights (forward, backward re-gather,
    recompute) must give the same bytes, or autograd mixes two weight sets."""
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    if shape.startswith("block checkpoint"):
        _checkpoint_blocks(model, reentrant=shape.endswith("reentrant"))
    handle = cgx.qsdp(model, weight_bits=4, grad_bits=8, weight_rounding="stochastic")
    logs = {name: [] for name in ("<root>", "blocks.0", "blocks.1")}
    for unit in handle.units:
        _record_all_gathers(unit.module, logs[unit.name])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    micro_batches = 3 if shape == "accumulation" else 1
    for step in range(3):
        for micro in range(micro_batches):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randint(0, 50, (4, 12), generator=g)
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            _loss_of(model, x, (x * 7 + 3) % 50, shape).backward()
        opt.step()
        opt.zero_grad()
    regathered, inconsistent = 0, []
    for name, log in logs.items():
        for outs in _by_input(log).values():
            regathered += len(outs) > 1
            if not all(torch.equal(o, outs[0]) for o in outs):
                inconsistent.append(name)
    return regathered, inconsistent, _full_params(model)


@pytest.mark.parametrize("shape", ["two forwards", "root checkpoint", "accumulation",
                                   "block checkpoint", "block checkpoint reentrant"])
def test_stochastic_weights_are_the_same_for_every_gather_of_the_same_weights(shape):
    results = values(run_ranks(_stochastic_weights_in_shapes, 2, args=(shape,)))
    for regathered, inconsistent, params in results:
        assert regathered > 0  # the shape does gather the same weights again
        assert inconsistent == [], inconsistent
        for name, value in params.items():
            assert torch.equal(value, results[0][2][name]), name


def _different_qsdp_calls(rank, world, what):
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world, timeout_s=20)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)))
    kwargs = {"weight_bits": {"weight_bits": 32 if rank == 1 else 8},
              "policy": {"policy": cgx.CompressionPolicy(bucket_size=128 if rank == 1 else 512)}}[what]
    try:
        cgx.qsdp(model, **kwargs)
        return "no error"
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("what", ["weight_bits", "policy"])
def test_ranks_calling_qsdp_differently_raise_on_every_rank(what):
    """One rank compressing, the other plain FSDP2 (or other layouts): both raise at the
    qsdp call, naming the difference, instead of meeting in mismatched collectives."""
    for rank, message in enumerate(values(run_ranks(_different_qsdp_calls, 2, args=(what,), timeout_s=60))):
        assert "called qsdp differently" in message, message
        expected = {"weight_bits": ["weight_bits 8 here, 32 on group rank 1", "weight_bits 32 here, 8 on group rank 0"][rank],
                    "policy": "units and layouts differ"}[what]
        assert expected in message, message


def _reshard_to_two(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import cgx

    init_cgx(rank, world)
    model = _model(0)
    _shard(model, init_device_mesh("cpu", (world,)), reshard_after_forward=2)
    handle = cgx.qsdp(model, weight_bits=8, grad_bits=8)
    losses = _train(model, rank, 3)
    return losses, handle.stats()


def test_reshard_after_forward_to_a_smaller_group_names_why_backward_gathers_exactly():
    for losses, stats in values(run_ranks(_reshard_to_two, 4, timeout_s=240)):
        assert losses[-1] < losses[0]
        assert stats["allgather"]["calls"] > 0 and stats["allgather"]["exact_calls"] > 0
        for reason in stats["exact_units"]["allgather"].values():
            assert "backward re-gather over reshard_after_forward's group of 2 ranks" in reason, reason


def test_the_checked_torch_range_is_the_one_users_see():
    """pyproject's lower bound is the oldest release the adapter claims (CI runs this file
    on it), and the README installs the newest (the full suite runs on it)."""
    import pathlib
    import re

    from cgx.fsdp2_access import CHECKED_TORCH

    root = pathlib.Path(__file__).resolve().parent.parent
    lower = re.search(r'"torch>=(\d+)\.(\d+)"', (root / "pyproject.toml").read_text())
    assert (int(lower[1]), int(lower[2])) == min(CHECKED_TORCH)
    installed = set(re.findall(r"pip install torch==(\d+)\.(\d+)\.\d+", (root / "README.md").read_text()))
    assert installed == {tuple(str(n) for n in max(CHECKED_TORCH))}
    fsdp_doc = (root / "docs" / "fsdp.md").read_text()
    assert ", ".join(f"{a}.{b}" for a, b in CHECKED_TORCH) in fsdp_doc
