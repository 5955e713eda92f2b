"""The max-min quantizer on its own (cgx.compress / cgx.decompress), no process group."""

from __future__ import annotations

import math

import pytest
import torch

import cgx


def step_per_bucket(x: torch.Tensor, bits: int, bucket: int) -> torch.Tensor:
    """The quantization step of each value's bucket: (max - min) / (2^bits - 1)."""
    n = x.numel()
    pad = (-n) % bucket
    padded = torch.cat([x, x[-1:].expand(pad)]) if pad else x
    b = padded.view(-1, bucket)
    step = (b.max(1).values - b.min(1).values) / (2**bits - 1)
    return step.repeat_interleave(bucket)[:n]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("bucket", [1, 3, 64, 512, 2048])
@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
def test_round_to_nearest_within_half_a_step(bits, bucket, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + bits)) * 3 + 1
    buf = cgx.compress(x, bits, bucket)
    assert buf.numel() == cgx.compressed_size(n, bits, bucket)
    y = cgx.decompress(buf, n, bits, bucket)
    slack = 4 * 2.0**-24 * x.abs().max()
    assert bool(((y - x).abs() <= step_per_bucket(x, bits, bucket) / 2 + slack).all())


def test_compressed_size_matches_the_documented_layout():
    # meta (8 bytes a bucket) | levels (ceil(n/8) * bits bytes) | raw tail, 16-byte aligned
    def up16(v):
        return (v + 15) // 16 * 16

    for n, bits, bucket in [(1000, 4, 64), (1, 1, 1), (777, 3, 100), (4096, 8, 512)]:
        meta = 8 * math.ceil(n / bucket)
        levels = math.ceil(n / 8) * bits
        assert cgx.compressed_size(n, bits, bucket) == up16(meta) + up16(levels)
    # with skip_incomplete_buckets, the partial last bucket travels raw (float32)
    n, bits, bucket = 1000, 4, 64
    q = n // bucket * bucket
    expected = 16 * math.ceil(8 * (q // bucket) / 16) + 16 * math.ceil(q // 8 * bits / 16) + 4 * (n - q)
    assert cgx.compressed_size(n, bits, bucket, skip_incomplete_buckets=True) == expected
    assert cgx.compressed_size(0, 4, 64) == 0


def test_skip_incomplete_buckets_sends_the_tail_exactly():
    x = torch.randn(1000)
    buf = cgx.compress(x, 2, 64, skip_incomplete_buckets=True)
    y = cgx.decompress(buf, 1000, 2, 64, skip_incomplete_buckets=True)
    assert torch.equal(y[960:], x[960:])
    assert not torch.equal(y[:960], x[:960])


def test_constant_bucket_decodes_exactly():
    x = torch.full((4096,), 3.25)
    assert torch.equal(cgx.decompress(cgx.compress(x, 1, 512), 4096, 1, 512), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_value_poisons_only_its_bucket(bad):
    x = torch.randn(2048)
    x[700] = bad
    y = cgx.decompress(cgx.compress(x, 4, 512), 2048, 4, 512)
    assert bool(torch.isnan(y[512:1024]).all())
    assert bool(torch.isfinite(y[:512]).all()) and bool(torch.isfinite(y[1024:]).all())


def test_range_overflowing_float_is_treated_as_non_finite():
    x = torch.tensor([-3e38, 3e38] + [0.0] * 62)
    assert bool(torch.isnan(cgx.decompress(cgx.compress(x, 1, 64), 64, 1, 64)).all())


FLOAT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("values", [
    [FLOAT_MAX, 0.0, 1.0, FLOAT_MAX / 2],     # min + levels * scale rounds past FLT_MAX
    [-FLOAT_MAX, 0.0, -1.0, -FLOAT_MAX / 2],  # levels * scale alone rounds past it
    [-FLOAT_MAX, -FLOAT_MAX / 3, -1.0, 0.0],
])
def test_finite_range_near_float_max_decodes_finite_within_half_a_step(bits, values):
    x = torch.tensor(values)
    buf = cgx.compress(x, bits, 4)
    step = (x.double().max() - x.double().min()) / (2**bits - 1)
    slack = 4 * 2.0**-24 * FLOAT_MAX  # float32 arithmetic, as in the test above
    for y in (cgx.decompress(buf, 4, bits, 4), cgx.decompress(buf, 4, bits, 4, out=torch.zeros(4), add=True)):
        assert bool(torch.isfinite(y).all()), y
        assert float((y.double() - x.double()).abs().max()) <= step / 2 + slack, (y, x)


def test_codec_arguments_checked_before_anything_is_written():
    x = torch.randn(10)
    with pytest.raises(TypeError, match="bits must be an int, got bool"):
        cgx.compress(x, True, 4)
    with pytest.raises(TypeError, match="bits must be an int"):
        cgx.compressed_size(10, 4.0, 4)
    with pytest.raises(ValueError, match="0..2\\^48"):
        cgx.compressed_size(2**62, 8, 1)
    out = torch.zeros(100, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        cgx.compress(x, 4, 4, out=out)
    assert bool((out == 0).all())  # refused before writing


def test_decompress_add_is_decompress_plus_destination():
    x = torch.randn(10_000)
    dst = torch.randn(10_000)
    buf = cgx.compress(x, 3, 100)
    expected = dst + cgx.decompress(buf, 10_000, 3, 100)
    cgx.decompress(buf, 10_000, 3, 100, out=dst, add=True)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_compressed_as_its_float32_values(dtype):
    x = torch.randn(5000).to(dtype)
    assert torch.equal(cgx.compress(x, 4, 128), cgx.compress(x.float(), 4, 128))


def test_stochastic_rounding_is_reproducible_and_unbiased():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    bits, bucket = 2, 256
    a = cgx.compress(x, bits, bucket, stochastic=True, seed=11)
    assert torch.equal(a, cgx.compress(x, bits, bucket, stochastic=True, seed=11))
    assert not torch.equal(a, cgx.compress(x, bits, bucket, stochastic=True, seed=12))
    step = step_per_bucket(x, bits, bucket)
    seeds = 2000
    total = torch.zeros(4096, dtype=torch.float64)
    for seed in range(seeds):
        y = cgx.decompress(cgx.compress(x, bits, bucket, stochastic=True, seed=seed), 4096, bits, bucket)
        assert bool(((y - x).abs() <= step * (1 + 1e-6)).all())
        total += y.double()
    # Per value the rounding error has standard deviation <= step / 2: the mean over the
    # seeds is within 5 standard errors of the exact value.
    bias = (total / seeds - x.double()).abs()
    assert bool((bias <= 5 * (step.double() / 2) / seeds**0.5 + 1e-6).all())
    rtn = cgx.decompress(cgx.compress(x, bits, bucket), 4096, bits, bucket)
    assert float(bias.mean()) < 0.2 * float((rtn - x).abs().mean())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 0, "bucket_size": 64}, "bits"),
        ({"bits": 9, "bucket_size": 64}, "bits"),
        ({"bits": 4, "bucket_size": 0}, "bucket_size"),
        ({"bits": 4, "bucket_size": 64, "threads": 0}, "threads must be in 1..1024, got 0"),
    ],
)
def test_bad_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cgx.compress(torch.randn(10), **kwargs)


@pytest.mark.parametrize("scheme, bits, bucket", [("maxmin", 3, 100), ("hadamard", 4, 1024)])
def test_threads_give_the_same_bytes_and_values(scheme, bits, bucket):
    """threads=: the buckets split over threads (tests/cpp/test_codec_threads.cpp has every
    shape), through the Python API."""
    x = torch.randn(300_007)
    one = cgx.compress(x, bits, bucket, stochastic=True, seed=5, scheme=scheme)
    assert torch.equal(cgx.compress(x, bits, bucket, stochastic=True, seed=5, scheme=scheme, threads=3), one)
    decoded = cgx.decompress(one, x.numel(), bits, bucket, scheme=scheme)
    assert torch.equal(cgx.decompress(one, x.numel(), bits, bucket, scheme=scheme, threads=3), decoded)
    with pytest.raises(ValueError, match="cgx.decompress: threads must be in 1..1024, got 2000"):
        cgx.decompress(one, x.numel(), bits, bucket, scheme=scheme, threads=2000)


def test_bad_tensors_raise():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        cgx.compress(torch.arange(10), 4, 64)
    buf = cgx.compress(torch.randn(100), 4, 64)
    with pytest.raises(ValueError, match="at least"):
        cgx.decompress(buf[:10], 100, 4, 64)


def test_tensors_on_other_devices_are_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="out must be on cpu"):
        cgx.compress(torch.randn(100), 4, 512, out=torch.empty(100, dtype=torch.uint8, device="meta"))
    with pytest.raises(RuntimeError, match="must be a CPU or CUDA tensor"):
        cgx.compress(torch.randn(100, device="meta"), 4, 512)
