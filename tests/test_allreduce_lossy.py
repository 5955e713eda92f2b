"""Compressed allreduce in the maxmin scheme: the error stays within its two-stage bound
(tests/bounds.py) and every rank ends with bit-identical output. (The hadamard scheme,
the default, has its own bound and tests: test_hadamard.py.)"""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch
import torch.distributed as dist

from bounds import allreduce_error_bound
from harness import init_cgx, run_ranks, values

SIZES = (1, 7, 1000, 1000003)


def make_input(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank-dependent scale and offset, so buckets see different ranges on each rank."""
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    return (torch.randn(n, generator=g) * (1 + rank) + 0.5 * rank).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _reduce_cases(rank, world, cases):
    """For each case: a cgx group with its settings, one allreduce per size; returns
    (case, size, digest, error, bound, bytes_sent) per allreduce."""
    import cgx

    init_cgx(rank, world)
    out = []
    for case in cases:
        config = cgx.Config(
            bits=case["bits"],
            bucket_size=case["bucket"],
            scheme=case.get("scheme", "maxmin"),
            codec_threads=case.get("threads", 0),
            minimal_size=0,
            inner_reduction=case.get("algorithm", "SRA"),
            stochastic_rounding=case.get("stochastic", False),
            skip_incomplete_buckets=case.get("skip", False),
            inner_communicator=case.get("inner", "SHM"),
            # Ranks told they sit on different hosts talk through Gloo, not shared memory.
            hostname=f"host{rank % case['hosts']}" if "hosts" in case else None,
        )
        group = dist.new_group(backend="cgx", pg_options=config)
        dtype = case.get("dtype", torch.float32)
        average = case.get("average", False)
        for n in case.get("sizes", SIZES):
            inputs = [make_input(r, n, dtype) for r in range(world)]
            t = inputs[rank].clone()
            before = cgx.stats(group)["bytes_sent"]
            dist.all_reduce(t, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)
            exact = torch.stack([x.double() for x in inputs]).sum(0) / (world if average else 1)
            error = float((t.double() - exact).abs().max())
            bound = allreduce_error_bound(
                inputs,
                case["bits"],
                algorithm=config.inner_reduction,
                stochastic=config.stochastic_rounding,
                average=average,
                out_dtype=dtype,
            )
            sent = cgx.stats(group)["bytes_sent"] - before
            out.append((case, n, digest(t), error, bound, sent))
        dist.destroy_process_group(group)
    return out


def check(results, world):
    per_rank = values(results)
    for entries in zip(*per_rank):
        case, n, _, error, bound, sent = entries[0]
        digests = {e[2] for e in entries}
        where = f"{case} n={n} world={world}"
        assert len(digests) == 1, f"ranks differ: {where}"
        assert error <= bound, f"error {error} > bound {bound}: {where}"
        # The compressed path really ran: bytes went out, fewer than float32 would need.
        assert sum(e[5] for e in entries) > 0, f"nothing sent: {where}"
        if n >= 1000 and case["bits"] <= 4:
            assert error > 0, f"exact result: the compressed path did not run? {where}"


def bits_and_buckets(world: int, bits: tuple, buckets: tuple) -> list[tuple[int, int]]:
    """Every width with every bucket size at 3 ranks (the uneven split); every width once,
    the bucket sizes in turn, at 2 and 4: the codec's path for a width and bucket size is
    the same whatever the world, the algorithm's chunks and the bound are not."""
    if world == 3:
        return list(itertools.product(bits, buckets))
    return [(b, buckets[i % len(buckets)]) for i, b in enumerate(bits)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sra_bits_buckets_sizes(world):
    cases = [{"bits": b, "bucket": k} for b, k in bits_and_buckets(world, (1, 2, 3, 4, 6, 8), (64, 512, 2048))]
    check(run_ranks(_reduce_cases, world, args=(cases,)), world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_bits_buckets_sizes(world):
    cases = [{"bits": b, "bucket": k, "algorithm": "Ring"}
             for b, k in bits_and_buckets(world, (1, 2, 4, 8), (64, 2048))]
    check(run_ranks(_reduce_cases, world, args=(cases,)), world)


def test_half_precision_and_average():
    cases = [
        {"bits": b, "bucket": 512, "dtype": d, "average": avg, "algorithm": alg, "sizes": (7, 1000, 100003)}
        for b, d, avg, alg in itertools.product(
            (2, 4, 8), (torch.float16, torch.bfloat16, torch.float32), (False, True), ("SRA", "Ring")
        )
    ]
    check(run_ranks(_reduce_cases, 3, args=(cases,)), 3)


def test_stochastic_rounding_and_raw_partial_buckets():
    cases = [
        {"bits": b, "bucket": 512, "stochastic": True, "algorithm": alg}
        for b, alg in itertools.product((1, 4, 8), ("SRA", "Ring"))
    ] + [{"bits": b, "bucket": 2048, "skip": True} for b in (2, 8)]
    check(run_ranks(_reduce_cases, 3, args=(cases,)), 3)


def test_codec_threads_change_no_bit():
    """CGX_CODEC_THREADS: each codec call's buckets split over 3 threads give the bits of
    one thread, for both algorithms and schemes, stochastic rounding and a raw last bucket."""
    cases = [
        {"bits": b, "bucket": k, "algorithm": alg, "scheme": scheme, "stochastic": stochastic, "skip": skip,
         "threads": threads, "sizes": (1000, 300007)}
        for alg, (scheme, b, k), stochastic, skip in itertools.product(
            ("SRA", "Ring"), (("maxmin", 4, 100), ("hadamard", 2, 512)), (False, True), (False, True))
        for threads in (1, 3)
    ]
    results = values(run_ranks(_reduce_cases, 2, args=(cases,)))
    check([[e for e in r if e[0]["scheme"] == "maxmin"] for r in results], 2)
    for entries in results:
        by_threads = {}
        for case, n, digest_, *_ in entries:
            key = tuple(sorted((k, v) for k, v in case.items() if k != "threads")) + (n,)
            by_threads.setdefault(key, {})[case["threads"]] = digest_
        assert len(by_threads) == len(cases) // 2 * 2
        for key, digests in by_threads.items():
            assert digests[1] == digests[3], key


def _threads_per_rank(rank, world):
    import cgx

    init_cgx(rank, world)
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, minimal_size=0, codec_threads=1 + 2 * rank))
    t = make_input(rank, 300007, torch.float32)
    dist.all_reduce(t, group=group)
    return digest(t)


def test_ranks_may_differ_in_codec_threads():
    """A rank's codec threads are its own (they change no bit): a group whose ranks use 1
    and 3 is formed and ends bit-identical."""
    digests = values(run_ranks(_threads_per_rank, 2))
    assert digests[0] == digests[1]


@pytest.mark.parametrize("world", [2, 4])
def test_cross_host_and_gloo_transports(world):
    cases = [
        {"bits": 4, "bucket": 512, "hosts": 2, "algorithm": alg, "sizes": (7, 1000003)}
        for alg in ("SRA", "Ring")
    ] + [{"bits": 2, "bucket": 64, "inner": "GLOO", "sizes": (1000, 1000003)}]
    check(run_ranks(_reduce_cases, world, args=(cases,)), world)


def _repeated_stochastic(rank, world, calls):
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=2, bucket_size=256, scheme="maxmin", minimal_size=0,
                                                 stochastic_rounding=True, seed=7, compression_auto=False))
    inputs = [make_input(r, 4096, torch.float32) for r in range(world)]
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    total = torch.zeros(4096, dtype=torch.float64)
    single_errors = []
    for _ in range(calls):
        t = inputs[rank].clone()
        dist.all_reduce(t)
        total += t.double()
        single_errors.append(float((t.double() - exact).abs().mean()))
    mean_error = float((total / calls - exact).abs().mean())
    return mean_error, sum(single_errors) / calls


def test_stochastic_rounding_is_unbiased_across_calls():
    """Each call draws fresh rounding; the mean over many calls converges to the exact sum
    (error ~ 1/sqrt(calls) of a single call's), which round-to-nearest would never do."""
    calls = 400
    for mean_error, single_error in values(run_ranks(_repeated_stochastic, 2, args=(calls,))):
        assert single_error > 0
        assert mean_error < 4 * single_error / calls**0.5, (mean_error, single_error)


FLOAT_MAX = torch.finfo(torch.float32).max


def _extreme_values(rank, world):
    """Values near FLT_MAX, sums that overflow, NaN and Inf: every rank gets the same
    bits, finite where the exact sum is finite and its buckets' ranges are."""
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=5, bucket_size=512, minimal_size=0,
                                                 compression_auto=False))
    cases = {}
    # A finite exact sum near FLT_MAX (5 bits: min + 31 * scale rounds past FLT_MAX).
    near_max = [torch.zeros(1024) for _ in range(world)]
    near_max[0][:4] = torch.tensor([FLOAT_MAX, 0.0, 1.0, FLOAT_MAX / 2])
    near_max[0][600:604] = torch.tensor([-FLOAT_MAX, 0.0, -1.0, -FLOAT_MAX / 2])
    cases["near max"] = near_max
    # Every rank has FLT_MAX at 0: the sum overflows in bucket 0 only.
    cases["sum overflows"] = [
        torch.cat([torch.tensor([FLOAT_MAX]), torch.randn(1023, generator=torch.Generator().manual_seed(r))])
        for r in range(world)]
    # NaN on rank 0 in bucket 0, +Inf on the last rank in bucket 1.
    poisoned = [torch.randn(2048, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    poisoned[0][5] = float("nan")
    poisoned[-1][600] = float("inf")
    cases["nan and inf"] = poisoned
    out = {}
    for name, inputs in cases.items():
        t = inputs[rank].clone()
        dist.all_reduce(t)
        everyone = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(everyone, t)
        same_bits = all(digest(e) == digest(everyone[0]) for e in everyone)
        nan_buckets = [b for b in range(t.numel() // 512) if bool(t[512 * b:512 * (b + 1)].isnan().all())]
        finite = [b for b in range(t.numel() // 512) if bool(t[512 * b:512 * (b + 1)].isfinite().all())]
        clean = [b for b in finite if b not in nan_buckets]
        errors_ok = True
        if name != "near max":  # the error of the finite buckets, against their own inputs
            for b in clean:
                part = [x[512 * b:512 * (b + 1)] for x in inputs]
                exact = torch.stack([x.double() for x in part]).sum(0)
                error = float((t[512 * b:512 * (b + 1)].double() - exact).abs().max())
                errors_ok &= error <= allreduce_error_bound(part, 5)
        else:
            exact = torch.stack([x.double() for x in inputs]).sum(0)
            errors_ok = float((t.double() - exact).abs().max()) <= allreduce_error_bound(inputs, 5)
        out[name] = (same_bits, nan_buckets, len(finite), errors_ok)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_extreme_values_same_on_every_rank_and_as_documented(world):
    for out in values(run_ranks(_extreme_values, world)):
        assert out["near max"] == (True, [], 2, True)
        assert out["sum overflows"] == (True, [0], 1, True)  # bucket 0 NaN, bucket 1 within bound
        assert out["nan and inf"] == (True, [0, 1], 2, True)
