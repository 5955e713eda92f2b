"""The CUDA codec against the CPU codec: the same wire format, the same bits.

Needs a GPU and a CUDA build of cgx (a CUDA torch and nvcc at build time); skipped
otherwise. Where no GPU is present the CUDA sources are still compiled by the build
(CMakeLists.txt: the sm_90 compile check), so a kernel that does not compile fails there.
"""

from __future__ import annotations

import pytest
import torch

import cgx

pytestmark = pytest.mark.skipif(
    not (cgx._C.cuda_built and torch.cuda.is_available()),
    reason="needs a GPU and cgx built against a CUDA torch with nvcc",
)

SIZES = [1, 7, 8, 511, 512, 513, 4096 + 3, 100_000]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inputs(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 1
    if n > 10:
        x[5] = -0.0  # the -0 / +0 extremes must not depend on the scan order
        x[: n // 10] = 0.25  # a constant bucket
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("bucket_size, skip", [(512, False), (100, False), (7, True), (512, True)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_bytes_equal_cpu_bytes(dtype, bits, bucket_size, skip, stochastic):
    for n in SIZES:
        x = inputs(n, dtype)
        cpu = cgx.compress(x, bits, bucket_size, stochastic=stochastic, seed=123,
                           skip_incomplete_buckets=skip)
        gpu = cgx.compress(x.cuda(), bits, bucket_size, stochastic=stochastic, seed=123,
                           skip_incomplete_buckets=skip)
        assert torch.equal(gpu.cpu(), cpu), (n, dtype, bits, bucket_size, skip, stochastic)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("add", [False, True])
def test_gpu_decode_equals_cpu_decode(bits, add):
    for n in SIZES:
        buf = cgx.compress(inputs(n, torch.float32), bits, 512)
        base = inputs(n, torch.float32, seed=1)
        cpu = base.clone()
        cgx.decompress(buf, n, bits, 512, out=cpu, add=add)
        gpu = base.cuda()
        cgx.decompress(buf.cuda(), n, bits, 512, out=gpu, add=add)
        assert torch.equal(gpu.cpu(), cpu), (n, bits, add)


def test_gpu_decode_into_half_types_rounds_once():
    n = 10_000
    buf = cgx.compress(inputs(n, torch.float32), 4, 512)
    exact = cgx.decompress(buf, n, 4, 512)
    for dtype in (torch.float16, torch.bfloat16):
        out = torch.empty(n, dtype=dtype, device="cuda")
        cgx.decompress(buf.cuda(), n, 4, 512, out=out)
        assert torch.equal(out.cpu(), exact.to(dtype))


def test_non_finite_buckets_decode_to_nan_on_both():
    x = inputs(2048, torch.float32)
    x[10] = float("nan")
    x[700] = float("inf")
    cpu = cgx.compress(x, 4, 512)
    gpu = cgx.compress(x.cuda(), 4, 512)
    assert torch.equal(gpu.cpu(), cpu)
    decoded = cgx.decompress(gpu, 2048, 4, 512, out=torch.empty(2048, device="cuda")).cpu()
    assert decoded[:1024].isnan().all() and not decoded[1024:].isnan().any()


@pytest.mark.parametrize("bits", [5, 7, 8])
def test_buckets_reaching_float_max_decode_finite_and_alike(bits):
    big = torch.finfo(torch.float32).max
    x = torch.zeros(1024)
    x[:4] = torch.tensor([big, 0.0, 1.0, big / 2])        # bucket 0: the sum rounds past FLT_MAX
    x[512:516] = torch.tensor([-big, 0.0, -1.0, -big / 2])  # bucket 1: the product does
    buf = cgx.compress(x, bits, 512)
    assert torch.equal(cgx.compress(x.cuda(), bits, 512).cpu(), buf)
    cpu = cgx.decompress(buf, 1024, bits, 512)
    gpu = cgx.decompress(buf.cuda(), 1024, bits, 512, out=torch.empty(1024, device="cuda")).cpu()
    assert torch.isfinite(cpu).all() and torch.equal(gpu, cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size, skip", [(512, False), (64, True), (8, False), (65536, False)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_hadamard_bytes_and_decoded_bits_equal_the_cpu_codecs(dtype, bits, bucket_size, skip,
                                                                  stochastic):
    for n in SIZES:
        x = inputs(n, dtype)
        args = dict(stochastic=stochastic, seed=321, skip_incomplete_buckets=skip, scheme="hadamard")
        cpu = cgx.compress(x, bits, bucket_size, **args)
        gpu = cgx.compress(x.cuda(), bits, bucket_size, **args)
        assert torch.equal(gpu.cpu(), cpu), (n, dtype, bits, bucket_size, skip, stochastic)
        if dtype != torch.float32:
            continue
        base = inputs(n, torch.float32, seed=2)
        for add in (False, True):
            on_cpu, on_gpu = base.clone(), base.cuda()
            cgx.decompress(cpu, n, bits, bucket_size, out=on_cpu, add=add, skip_incomplete_buckets=skip,
                           scheme="hadamard")
            cgx.decompress(gpu, n, bits, bucket_size, out=on_gpu, add=add, skip_incomplete_buckets=skip,
                           scheme="hadamard")
            assert torch.equal(on_gpu.cpu(), on_cpu), (n, bits, bucket_size, skip, add)


def test_gpu_hadamard_non_finite_and_huge_buckets_are_nan_on_both():
    x = inputs(4096, torch.float32)
    x[10] = float("nan")
    x[700] = float("inf")
    x[1500] = 2.0**100  # the scheme's limit: stored as NaN
    cpu = cgx.compress(x, 2, 512, scheme="hadamard")
    gpu = cgx.compress(x.cuda(), 2, 512, scheme="hadamard")
    assert torch.equal(gpu.cpu(), cpu)
    decoded = cgx.decompress(gpu, 4096, 2, 512, out=torch.empty(4096, device="cuda"), scheme="hadamard").cpu()
    nan = torch.zeros(4096, dtype=torch.bool)
    nan[:512] = nan[512:1024] = nan[1024:1536] = True
    assert torch.equal(decoded.isnan(), nan)
