"""The hadamard scheme (docs/wire-format.md): each bucket rotated, levels placed for a
normal distribution. Its stated bound checked against a float64 reference of the
rotation, its unbiased stochastic rounding, its shorter last bucket in maxmin, the policy
that chooses it, and compressed allreduces and DDP training with it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import cgx
from harness import init_cgx, run_ranks, values

# Lloyd-Max levels of a standard normal (upper halves), as docs/wire-format.md lists them.
LEVELS = {1: [0.7978846], 2: [0.4527800, 1.5104176], 3: [0.2450942, 0.7560053, 1.3439093, 2.1519457],
          4: [0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896]}
# The mean squared error of those levels on a standard normal (Lloyd-Max's).
NORMAL_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def signs(n: int) -> torch.Tensor:
    return torch.tensor([-1.0 if lowbias32(j ^ 0x5BD1E995) & 1 else 1.0 for j in range(n)], dtype=torch.float64)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotated(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """The whole buckets of x rotated, in float64: (buckets, B) of H D x / B."""
    whole = x.numel() // bucket * bucket
    b = x[:whole].double().view(-1, bucket) * signs(bucket)
    return b @ hadamard(bucket) / bucket


def bound_per_bucket(x: torch.Tensor, bits: int, bucket: int) -> torch.Tensor:
    """The stated bound on |decoded - x| (L2 over each whole bucket): sqrt(B) times the L2
    norm of the rotated values' per-value bound max(gap / 2 * rms, |y| - top * rms)."""
    y = rotated(x, bucket)
    rms = y.pow(2).mean(1, keepdim=True).sqrt()
    upper = LEVELS[bits]
    levels = [-v for v in reversed(upper)] + upper
    half_gap = max(b - a for a, b in zip(levels, levels[1:])) / 2
    per_value = torch.maximum(half_gap * rms, y.abs() - upper[-1] * rms)
    return math.sqrt(bucket) * per_value.pow(2).sum(1).sqrt()


def roundtrip(x, bits, bucket, **kw):
    buf = cgx.compress(x, bits, bucket, scheme="hadamard", **kw)
    assert buf.numel() == cgx.compressed_size(x.numel(), bits, bucket, scheme="hadamard")
    return cgx.decompress(buf, x.numel(), bits, bucket, scheme="hadamard")


def inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # StudentT draws from the global generator
    outliers = torch.randn(n, generator=g)
    outliers[:: 97] *= 1000
    constant = torch.full((n,), 3.25)
    zero_buckets = torch.randn(n, generator=g)
    zero_buckets[: n // 2] = 0
    return {"normal": torch.randn(n, generator=g) * 5 + 2, "outliers": outliers,
            "heavy tails": torch.distributions.StudentT(2.0).sample((n,)), "constant": constant,
            "half zero": zero_buckets, "tiny": torch.randn(n, generator=g) * 1e-30}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [8, 128, 512, 4096])
def test_whole_buckets_within_the_stated_bound(bits, bucket):
    n = 8 * 4096
    for name, x in inputs(n, bits * bucket).items():
        y = roundtrip(x, bits, bucket)
        err = (y.double() - x.double()).view(-1, bucket).pow(2).sum(1).sqrt()
        slack = 1e-5 * x.double().view(-1, bucket).norm(dim=1) + 1e-35
        bound = bound_per_bucket(x, bits, bucket)
        assert bool((err <= bound * (1 + 1e-5) + slack).all()), (name, float((err - bound).max()))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_error_on_normal_values_is_the_lloyd_max_error(bits):
    """What the levels were placed for: on rotated buckets the squared error is the
    normal distribution's Lloyd-Max error, far below maxmin's at the same bits."""
    torch.manual_seed(bits)
    x = torch.distributions.StudentT(3.0).sample((1 << 20,))  # not normal before rotation
    y = roundtrip(x, bits, 512)
    relative = float((y - x).pow(2).sum() / x.pow(2).sum())
    assert relative == pytest.approx(NORMAL_MSE[bits], rel=0.05)
    maxmin = cgx.decompress(cgx.compress(x, bits, 512), x.numel(), bits, 512)
    assert relative < 0.5 * float((maxmin - x).pow(2).sum() / x.pow(2).sum())


def test_rotation_alone_is_recovered_within_float_rounding():
    """A bucket whose rotated values are all +-c (rms c) holds, at 1 bit, +-0.7978846 c:
    the inverse rotation gives back 0.7978846 times the input, within float rounding."""
    bucket = 64
    y = torch.where(torch.arange(bucket) % 3 == 0, 1.0, -1.0).double() * 2.0
    x = (signs(bucket) * (hadamard(bucket) @ y)).float()  # rotate(x) = y exactly
    decoded = roundtrip(x, 1, bucket)
    assert torch.allclose(decoded.double(), x.double() * 0.7978846, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_rounding_is_unbiased(bits):
    """Rotated values inside the outer levels: over seeds the mean decoded value is the
    input (the rotation is linear, so unbiased there is unbiased here)."""
    bucket = 128
    g = torch.Generator().manual_seed(bits)
    y = torch.where(torch.rand(bucket, generator=g) < 0.5, 1.0, -1.0).double()
    y *= 1 + 0.3 * torch.rand(bucket, generator=g).double()  # |y| / rms stays under 1.51
    x = (signs(bucket) * (hadamard(bucket) @ y)).float()
    draws = torch.stack([roundtrip(x, bits, bucket, stochastic=True, seed=s) for s in range(4000)])
    mean = draws.double().mean(0)
    spread = draws.double().std(0).max() / math.sqrt(len(draws))
    assert float((mean - x.double()).abs().max()) < 5 * float(spread)
    assert not torch.equal(draws[0], draws[1])  # the seed chose different levels


def test_shorter_last_bucket_travels_as_maxmin():
    x = torch.randn(512 + 100, generator=torch.Generator().manual_seed(5)) * 7
    had = cgx.compress(x, 3, 512, scheme="hadamard")
    tail = cgx.compress(x[512:], 3, 512)
    # Meta: one rms, then the tail's (min, scale); levels from byte 16: 77 groups of 8
    # values at 3 bytes each, the tail's 13 groups last.
    assert had.numel() == 256
    assert torch.equal(had[4:12], tail[0:8])
    assert torch.equal(had[16 + 192:16 + 231], tail[16:16 + 39])
    y = roundtrip(x, 3, 512)
    step = float(x[512:].max() - x[512:].min()) / 7
    assert float((y[512:] - x[512:]).abs().max()) <= step / 2 + 1e-5


def test_non_finite_and_huge_buckets_decode_to_nan_alone():
    x = torch.randn(4 * 128, generator=torch.Generator().manual_seed(1))
    x[5] = float("nan")
    x[128 + 7] = float("inf")
    x[256 + 9] = 2.0**100  # past the rotated scheme's range (docs/wire-format.md)
    y = roundtrip(x, 2, 128)
    assert bool(y[:384].isnan().all())
    assert bool(y[384:].isfinite().all())
    x[256 + 9] = 2.0**99
    assert bool(roundtrip(x, 2, 128)[256:].isfinite().all())


def test_same_input_same_bytes_and_bad_parameters_raise():
    x = torch.randn(10_000)
    assert torch.equal(cgx.compress(x, 2, 256, scheme="hadamard"), cgx.compress(x.clone(), 2, 256, scheme="hadamard"))
    with pytest.raises(ValueError, match="hadamard scheme quantizes to 1..4 bits, got 5"):
        cgx.compress(x, 5, 512, scheme="hadamard")
    with pytest.raises(ValueError, match="power of two in 8..65536, got 100"):
        cgx.compress(x, 2, 100, scheme="hadamard")
    with pytest.raises(ValueError, match="power of two in 8..65536, got 4"):
        cgx.compressed_size(100, 2, 4, scheme="hadamard")
    with pytest.raises(ValueError, match="scheme must be 'maxmin' or 'hadamard', got 'lloyd'"):
        cgx.compress(x, 2, 512, scheme="lloyd")


def test_policy_uses_hadamard_where_it_fits():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    policy = cgx.CompressionPolicy(bits=2, scheme="hadamard", rules=[
        cgx.LayerRule(pattern="1.weight", bits=8), cgx.LayerRule(pattern="2.weight", bits=3, bucket_size=96)])
    settings = policy.resolve(model)
    assert settings["0.weight"] == cgx.LayerSetting(2, 512, "hadamard")
    assert settings["1.weight"] == cgx.LayerSetting(8, 512, "maxmin")  # hadamard stops at 4 bits
    assert settings["2.weight"] == cgx.LayerSetting(3, 96, "maxmin")  # not a power of two
    assert not settings["0.bias"].compressed
    with pytest.raises(ValueError, match="LayerRule.*hadamard scheme quantizes to 1..4 bits, got 8"):
        cgx.LayerRule(pattern="*", bits=8, bucket_size=512, scheme="hadamard")
    # Without a bucket size of its own the rule is checked with the policy's, at resolve().
    bad = cgx.CompressionPolicy(bits=2, bucket_size=96, rules=[cgx.LayerRule(pattern="0.weight", bits=2,
                                                                             scheme="hadamard")])
    with pytest.raises(ValueError, match="LayerRule for '0.weight'.*power of two in 8..65536, got 96"):
        bad.resolve(model)
    with pytest.raises(ValueError, match="scheme must be one of 'maxmin', 'hadamard', got 'x'"):
        cgx.CompressionPolicy(scheme="x")


def test_qsdp_widths_take_the_policy_s_scheme_where_it_fits():
    """qsdp's weight_bits / grad_bits replace the policy's and the rules' bits: the scheme
    is then fitted to those bits, not to the replaced ones (8 bits would have made it
    maxmin)."""
    from cgx.fsdp import _every_parameters_setting

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    rules = [cgx.LayerRule(pattern="1.weight", bits=8), cgx.LayerRule(pattern="2.weight", bits=6, scheme="maxmin")]
    for policy in (cgx.CompressionPolicy(bits=8, rules=rules), cgx.CompressionPolicy(bits=5, rules=rules)):
        names = dict(model.named_parameters())
        at = {bits: {n: _every_parameters_setting(model, policy, bits)[id(p)] for n, p in names.items()}
              for bits in (4, 8, 32)}
        assert at[4]["0.weight"] == at[4]["1.weight"] == cgx.LayerSetting(4, 512, "hadamard")
        assert at[4]["2.weight"] == cgx.LayerSetting(4, 512, "maxmin")  # the rule's own scheme
        assert at[8]["0.weight"] == cgx.LayerSetting(8, 512, "maxmin")
        assert not at[4]["0.bias"].compressed and not at[8]["0.bias"].compressed
        assert not any(s.compressed for s in at[32].values())


def test_one_bit_maxmin_buckets_under_error_feedback_are_warned_about():
    """At 1 bit a maxmin bucket's residuals grow without bound under feedback
    (docs/error-feedback.md): a state whose layers have such buckets and feed back says
    so, naming them; whole hadamard buckets, 2 bits, or no feedback do not."""
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))  # 4096 and 640 values
    cases = [(cgx.CompressionPolicy(bits=1), None, ["1.weight"]),  # 640 = 512 + a maxmin tail
             (cgx.CompressionPolicy(bits=1, scheme="maxmin"), None, ["0.weight", "1.weight"]),
             (cgx.CompressionPolicy(bits=1), False, []),
             (cgx.CompressionPolicy(bits=2, scheme="maxmin"), None, [])]
    for policy, feedback, named in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cgx.CGXState(None, model, policy, error_feedback=feedback)
        messages = [str(w.message) for w in caught if "1 bit with error feedback" in str(w.message)]
        assert bool(messages) == bool(named), (policy.scheme, policy.bits, feedback, messages)
        if named:
            assert str(named) in messages[0]


def test_adaptive_candidates_carry_a_scheme():
    """The errors and bytes are the scheme's: 2-bit hadamard errs about 7.5x as much as
    4-bit maxmin on normal values (0.1175 against about 0.016), so a budget of 10x the
    default's takes it for every layer, and one of 1x for none."""
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(64, 512, generator=g), "b": torch.randn(64, 512, generator=g) * 1e-3}
    for alpha, expected in ((10.0, cgx.LayerSetting(2, 512, "hadamard")), (1.0, cgx.LayerSetting(4, 512))):
        adaptive = cgx.AdaptiveBits(candidates=[(2, 512, "hadamard"), (4, 512)], default=(4, 512), alpha=alpha)
        for name, grad in grads.items():
            adaptive.accumulate(name, grad)
        assert adaptive.choose() == {"a": expected, "b": expected}, alpha
    with pytest.raises(ValueError, match="candidate.*hadamard scheme quantizes to 1..4 bits, got 6"):
        cgx.AdaptiveBits(candidates=[(6, 512, "hadamard"), (4, 512)], default=(4, 512))
    # The defaults follow the default scheme: hadamard up to 4 bits, maxmin from 4 up.
    defaults = cgx.AdaptiveBits()
    assert {c.scheme for c in defaults.candidates if c.bits < 4} == {"hadamard"}
    assert defaults.default == cgx.LayerSetting(4, 512, "maxmin")


def _allreduce_in_groups(rank, world, configs):
    init_cgx(rank, world)
    out = []
    for config in configs:
        group = dist.new_group(backend="cgx", pg_options=config)
        t = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        dist.all_reduce(t, group=group)
        out.append(t)
    return out


def test_a_groups_scheme_is_hadamard_by_default_and_maxmin_where_hadamard_cannot_go():
    """The default scheme is hadamard; where the group's bits or bucket size are beyond
    it (above 4 bits, a bucket that is not a power of two) the group quantizes in maxmin,
    as a CompressionPolicy does, rather than refusing the default."""
    quiet = dict(minimal_size=0, compression_auto=False)
    configs = [cgx.Config(bits=2, **quiet), cgx.Config(bits=2, scheme="hadamard", **quiet),
               cgx.Config(bits=2, scheme="maxmin", **quiet),
               cgx.Config(bits=8, **quiet), cgx.Config(bits=8, scheme="maxmin", **quiet),
               cgx.Config(bits=2, bucket_size=100, scheme="hadamard", **quiet),
               cgx.Config(bits=2, bucket_size=100, scheme="maxmin", **quiet)]
    assert cgx.Config().scheme == "hadamard"
    ranks = values(run_ranks(_allreduce_in_groups, 2, args=(configs,), timeout_s=120))
    assert all(torch.equal(a, b) for a, b in zip(*ranks))
    default2, hadamard2, maxmin2, default8, maxmin8, hadamard100, maxmin100 = ranks[0]
    assert torch.equal(default2, hadamard2) and not torch.equal(default2, maxmin2)
    assert torch.equal(default8, maxmin8)
    assert torch.equal(hadamard100, maxmin100)


# ---- in collectives


def _allreduce_cases(rank, world, cases):
    init_cgx(rank, world)
    out = []
    for bits, bucket, algorithm in cases:
        group = dist.new_group(backend="cgx", pg_options=cgx.Config(
            bits=bits, bucket_size=bucket, scheme="hadamard", minimal_size=0, inner_reduction=algorithm))
        for n in (7, 1000, 1 << 20):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(r * 7 + n)) * (1 + r) for r in range(world)]
            t = xs[rank].clone()
            dist.all_reduce(t, group=group)
            exact = torch.stack(xs).double().sum(0)
            out.append(((bits, bucket, algorithm, n), t, float((t.double() - exact).pow(2).sum()),
                        sum(float(x.double().norm()) for x in xs) ** 2))
        dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_bit_identical_with_the_expected_error(world):
    """Every rank ends with the same bits. On whole buckets each quantization stage adds
    about the Lloyd-Max error of what it quantizes (at most the sum of the ranks' norms,
    squared), so the squared error stays under 1.5x that per stage: a rotation that
    differed between encoder and decoder would err by about the norm itself."""
    cases = [(2, 512, "SRA"), (4, 128, "SRA"), (3, 256, "Ring")]
    per_rank = values(run_ranks(_allreduce_cases, world, args=(cases,), timeout_s=240))
    for entries in zip(*per_rank):
        (bits, bucket, algorithm, n), t, sq_error, scale = entries[0]
        assert all(torch.equal(t, e[1]) for e in entries), f"ranks differ: {entries[0][0]}"
        if n % bucket == 0 or n > 100_000:
            stages = 2 if algorithm == "SRA" else world
            assert 0 < sq_error <= 1.5 * stages * NORMAL_MSE[bits] * scale, entries[0][0]


def _hierarchical(rank, world, intra_compress):
    init_cgx(rank, world)
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(
        bits=3, minimal_size=0, compression_auto=False, hostname=f"host{rank // 2}", intra_compress=intra_compress))
    out = []
    for n in (1000, 1 << 20):  # the larger one pipelined in pieces
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(r * 7 + n)) * (1 + r) for r in range(world)]
        t = xs[rank].clone()
        dist.all_reduce(t, group=group)
        exact = torch.stack(xs).double().sum(0)
        out.append((n, t, float((t.double() - exact).pow(2).sum()), sum(float(x.double().norm()) for x in xs) ** 2,
                    cgx.get_backend(group).hierarchical))
    return out


@pytest.mark.parametrize("intra_compress", [True, False])
def test_the_hierarchical_allreduce_in_the_default_scheme(intra_compress):
    """2 hosts x 2 ranks, the default scheme: bit-identical ranks, and about the Lloyd-Max
    error of each quantization stage (those of bounds.hierarchical_stages)."""
    from bounds import hierarchical_stages

    partial, final = hierarchical_stages(2, 2, "SRA", "SRA", intra_compress=intra_compress)
    per_rank = values(run_ranks(_hierarchical, 4, args=(intra_compress,), timeout_s=180))
    for entries in zip(*per_rank):
        n, t, sq_error, scale, hierarchical = entries[0]
        assert hierarchical
        assert all(torch.equal(t, e[1]) for e in entries), f"ranks differ at n={n}"
        assert 0 < sq_error <= 1.5 * (partial + final) * NORMAL_MSE[3] * scale, n


def _mixed_schemes(rank, world):
    init_cgx(rank, world)
    backend = cgx.get_backend(dist.new_group(backend="cgx", pg_options=cgx.Config(minimal_size=0)))
    t = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    layout = [(0, 2048, 2, 512, "hadamard"), (2048, 1024, 32, 1), (3072, 1024, 4, 512)]
    backend.allreduce_layout(t, layout).wait()
    mine = [(0, 4096, 2, 512, "hadamard" if rank == 0 else "maxmin")]
    try:
        backend.allreduce_layout(torch.ones(4096), mine).wait()
    except RuntimeError as e:
        return t, str(e)
    return t, None


def test_layouts_mix_schemes_and_ranks_that_differ_raise():
    results = values(run_ranks(_mixed_schemes, 2, timeout_s=120))
    assert torch.equal(results[0][0], results[1][0])
    for _, error in results:
        assert error is not None and "hadamard" in error, error


def _diloco_layout(rank, world):
    init_cgx(rank, world, pg_options=cgx.Config(scheme="hadamard"))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    diloco = cgx.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    return [segment[4] for segment in diloco._fragments[0].layout if segment[2] != 32]


def test_diloco_takes_the_groups_scheme():
    assert values(run_ranks(_diloco_layout, 1))[0] == ["hadamard", "hadamard"]


def _train(rank, world, two_level):
    init_cgx(rank, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=2, scheme="hadamard"), two_level=two_level)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    target = torch.nn.Linear(32, 4)
    losses = []
    for _ in range(30):
        x = torch.randn(64, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), target(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    saved = state.state_dict()
    return (torch.cat([p.detach().flatten() for p in model.parameters()]), losses,
            saved["layer_settings"], state.stats()["payload_bytes"])


@pytest.mark.parametrize("two_level", [True, False])
def test_ddp_hook_trains_with_hadamard_and_checkpoints_the_scheme(two_level):
    results = values(run_ranks(_train, 2, args=(two_level,), timeout_s=180))
    assert torch.equal(results[0][0], results[1][0])
    losses = results[0][1]
    assert losses[-1] < 0.5 * losses[0], losses  # it learned
    assert results[0][2]["0.weight"] == (2, 512, "hadamard")
    assert results[0][3] == 30 * (cgx.compressed_size(32 * 256, 2, 512, scheme="hadamard")
                                  + cgx.compressed_size(256 * 4, 2, 512, scheme="hadamard") + 4 * (256 + 4))
