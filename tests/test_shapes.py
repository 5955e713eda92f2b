"""The shapes real training loops take, for the DDP hook and for qsdp: in each, replicas
end bit-identical, the layers that travel raw are bit-identical to Gloo's reduction of
the same local gradients (2 ranks: no summation-order difference), and a checkpoint
taken mid-run resumes bit for bit like the run that went straight on.

Every shape of one framework runs in one set of processes (spawning is the slow part).
"""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist

from harness import init_cgx, run_ranks, values

HOOK_SHAPES = ["plain", "no_sync", "static_graph", "find_unused", "gradient_as_bucket_view",
               "checkpointing", "two forwards", "bf16 autocast"]
QSDP_SHAPES = ["plain", "accumulation", "checkpointing", "two forwards", "bf16 mixed precision",
               "no reshard after forward"]
STEPS, SAVED_AT = 4, 2


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def _gather_equal(tensor, group=None):
    """Whether every rank holds the same bits."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, tensor, group=group)
    return all(torch.equal(everyone[0], t) for t in everyone)


def _flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


# ---- DDP and the cgx hook


class HookNet(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(32, 96)
        self.hidden = torch.nn.Linear(96, 96)
        self.norm = torch.nn.LayerNorm(96)
        self.head = torch.nn.Linear(96, 10)
        self.spare = torch.nn.Linear(8, 8) if shape == "find_unused" else None
        self.shape = shape

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.embed(x))
        if self.shape == "checkpointing":
            h = checkpoint(self.hidden, h, use_reentrant=False)
        else:
            h = self.hidden(h)
        return self.head(self.norm(torch.relu(h)))


def _ddp_step(ddp, opt, rank, step, shape):
    loss_of = lambda x, y: torch.nn.functional.cross_entropy(ddp(x).float(), y)  # noqa: E731
    if shape == "no_sync":
        with ddp.no_sync():
            for micro in (1, 2):
                loss_of(*_batch(rank, step, micro)).backward()
    x, y = _batch(rank, step)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape == "bf16 autocast"):
        loss = loss_of(x[:4], y[:4]) + loss_of(x[4:], y[4:]) if shape == "two forwards" else loss_of(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _hook_run(rank, shape, gloo, steps, start=0, saved=None):
    """`steps` steps of `shape` from `start` (loading `saved` first, if given). Returns the
    model, the state and the checkpoint it would save; checks every hook call's raw layers
    against Gloo's reduction of the same local gradients."""
    import cgx
    from cgx.layers import RAW_BITS, bucket_plan
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = HookNet(shape)
    kwargs = {"static_graph": shape == "static_graph", "find_unused_parameters": shape == "find_unused",
              "gradient_as_bucket_view": shape == "gradient_as_bucket_view"}
    ddp = DDP(model, bucket_cap_mb=0.01, **kwargs)
    state = cgx.CGXState(None, compression_params={"bits": 2, "bucket_size": 128}, layer_min_size=1000,
                         warmup_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["cgx"])
    calls = []

    def recording_hook(state, bucket):
        local = bucket.buffer().clone()
        future = cgx.cgx_hook(state, bucket)
        raw = [(o, n) for o, n, bits, *_ in bucket_plan(bucket, state._settings_by_param)[0] if bits == RAW_BITS]

        call = [local, None, raw]
        calls.append(call)  # in call order, the same on every rank

        def keep(done):  # a copy: DDP refills the bucket's buffer in later steps
            call[1] = done.value().clone()
            return done.value()
        return future.then(keep)

    ddp.register_comm_hook(state, recording_hook)
    for step in range(start, start + steps):
        _ddp_step(ddp, opt, rank, step, shape)
    raw_exact = True
    for local, reduced, raw in calls:
        reference = local / dist.get_world_size()  # the hook divides first, as torch's do
        dist.all_reduce(reference, group=gloo)
        raw_exact = raw_exact and all(torch.equal(reduced[o:o + n], reference[o:o + n]) for o, n in raw)
    checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                  "cgx": state.state_dict()}
    return model, state, ddp, opt, raw_exact and bool(calls), checkpoint


def _hook_shapes(rank, world):
    import cgx
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The suite runs one intra-op thread a process (tests/conftest.py); the DDP loops run on
    # a pool of two, as a user's ranks often do, so that cgx's threads (the hook's calls,
    # their callbacks) beside torch's pool stay tested.
    torch.set_num_threads(2)
    init_cgx(rank, world)
    gloo = dist.new_group(backend="gloo")
    out = {}
    for shape in HOOK_SHAPES:
        model, state, _, opt, raw_exact, checkpoint = _hook_run(rank, shape, gloo, SAVED_AT)
        # The straight run goes on in a new DDP too: DDP lays its buckets out otherwise in
        # its first iteration, which moves two-level residuals between owners.
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        ddp = DDP(model, bucket_cap_mb=0.01, static_graph=shape == "static_graph",
                  find_unused_parameters=shape == "find_unused",
                  gradient_as_bucket_view=shape == "gradient_as_bucket_view")
        ddp.register_comm_hook(state, cgx.cgx_hook)
        for step in range(SAVED_AT, STEPS):
            _ddp_step(ddp, opt, rank, step, shape)
        buf.seek(0)
        resumed, resumed_state, *_, raw_exact_after, _ = _hook_run(rank, shape, gloo, STEPS - SAVED_AT,
                                                                   start=SAVED_AT, saved=torch.load(buf))
        out[shape] = {
            "replicas identical": _gather_equal(_flat(model), gloo),
            "raw layers equal Gloo's": raw_exact and raw_exact_after,
            "resumed equals straight": torch.equal(_flat(model), _flat(resumed)),
            "compressed": resumed_state.stats()["compression_ratio"] > 2,
            "steps": (state.step, resumed_state.step),
        }
    return out


def test_hook_in_every_training_loop_shape():
    for out in values(run_ranks(_hook_shapes, 2, timeout_s=400)):
        for shape, checks in out.items():
            assert checks.pop("steps") == (STEPS, STEPS), shape
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, (shape, failed)


# ---- FSDP2 and qsdp


def _tiny(seed=0, dim=26, vocab=50):
    from test_fsdp import _model

    return _model(seed, dim, vocab)


class _RecordingReduceScatter:
    """Wraps a unit's reduce-scatter comm and keeps (input, output) of every call."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        given = input_tensor.clone()
        self.inner(output_tensor, input_tensor, group, op, async_op=False)
        self.log.append((given, output_tensor.clone()))


def _qsdp_run(rank, shape, gloo, steps, start=0, saved=None):
    import cgx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    from test_fsdp import _checkpoint_blocks, _loss_of

    model = _tiny()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kwargs = {}
    if shape == "bf16 mixed precision":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if shape == "no reshard after forward":
        kwargs["reshard_after_forward"] = False
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if shape == "checkpointing":
        _checkpoint_blocks(model, reentrant=False)
    handle = cgx.qsdp(model, weight_bits=4, grad_bits=4, weight_rounding="stochastic", error_feedback=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        handle.load_state_dict(saved["cgx"])
    logs = {}
    for unit in handle.units:
        inner = unit.module._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
        logs[unit.name] = (unit.plans["reduce_scatter"], [])
        unit.module.set_custom_reduce_scatter(
            type("Recording", (_RecordingReduceScatter, ReduceScatter), {})(inner, logs[unit.name][1]))
    micro_batches = 3 if shape == "accumulation" else 1
    for step in range(start, start + steps):
        for micro in range(micro_batches):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randint(0, 50, (4, 12), generator=g)
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            _loss_of(model, x, (x * 7 + 3) % 50, "two forwards" if shape == "two forwards" else "plain").backward()
        opt.step()
        opt.zero_grad()
    raw_exact, calls = True, 0
    for plan, log in logs.values():
        for given, out in log:
            calls += 1
            reference = torch.empty_like(out)
            dist.reduce_scatter_tensor(reference, given, group=gloo)
            reference /= dist.get_world_size()
            raw_exact = raw_exact and all(torch.equal(out[o:o + n], reference[o:o + n])
                                          for o, n, bits, *_ in plan if bits == 32)
    checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                  "cgx": handle.state_dict()}
    return model, handle, raw_exact and calls > 0, checkpoint


def _qsdp_shapes(rank, world):
    init_cgx(rank, world)
    gloo = dist.new_group(backend="gloo")
    out = {}
    for shape in QSDP_SHAPES:
        straight, handle, raw_exact, _ = _qsdp_run(rank, shape, gloo, STEPS)
        _, _, raw_exact_first, saved = _qsdp_run(rank, shape, gloo, SAVED_AT)
        resumed, _, raw_exact_after, _ = _qsdp_run(rank, shape, gloo, STEPS - SAVED_AT, start=SAVED_AT, saved=saved)
        full = {n: p.full_tensor() for n, p in straight.named_parameters()}
        again = {n: p.full_tensor() for n, p in resumed.named_parameters()}
        stats = handle.stats()
        out[shape] = {
            "replicas identical": all(_gather_equal(v, gloo) for v in full.values()),
            "raw layers equal Gloo's": raw_exact and raw_exact_first and raw_exact_after,
            "resumed equals straight": all(torch.equal(full[n], again[n]) for n in full),
            "compressed": all(stats[k]["calls"] > 0 and stats[k]["exact_calls"] == 0
                              for k in ("allgather", "reduce_scatter")),
        }
    return out


def test_qsdp_in_every_training_loop_shape():
    for out in values(run_ranks(_qsdp_shapes, 2, timeout_s=400)):
        for shape, checks in out.items():
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, (shape, failed)
