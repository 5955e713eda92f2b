"""Everything that is not compressed gives exactly Gloo's result: other dtypes and ops,
small tensors, 32 bits, and every collective other than allreduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bounds import allreduce_error_bound
from harness import init_cgx, run_ranks, values


def _pair(rank, world, bits):
    """Runs every call on a cgx group and on a Gloo group of the same ranks."""
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=bits, minimal_size=16))
    return dist.group.WORLD, dist.new_group(backend="gloo")


def _input(rank, n, dtype):
    g = torch.Generator().manual_seed(rank * 7919 + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype) * (rank + 1)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


ALLREDUCE_CASES = [
    # (dtype, op, numel): integer / float64 dtypes, MAX/MIN/PRODUCT, small float32 tensors
    (torch.int32, dist.ReduceOp.SUM, 100_000),
    (torch.int64, dist.ReduceOp.SUM, 100_000),
    (torch.float64, dist.ReduceOp.SUM, 100_000),
    (torch.float32, dist.ReduceOp.MAX, 100_000),
    (torch.float32, dist.ReduceOp.MIN, 100_000),
    (torch.int64, dist.ReduceOp.MAX, 1000),
    (torch.float32, dist.ReduceOp.PRODUCT, 1000),
    (torch.float32, dist.ReduceOp.SUM, 16),  # at the minimal size: exact
    (torch.float16, dist.ReduceOp.SUM, 5),
]


def _exact_allreduce(rank, world, bits):
    cgx_group, gloo_group = _pair(rank, world, bits)
    out = []
    cases = ALLREDUCE_CASES + ([(torch.float32, dist.ReduceOp.SUM, 100_000)] if bits == 32 else [])
    for dtype, op, n in cases:
        a = _input(rank, n, dtype)
        b = a.clone()
        dist.all_reduce(a, op=op, group=cgx_group)
        dist.all_reduce(b, op=op, group=gloo_group)
        out.append((str(dtype), str(op), n, torch.equal(a, b)))
    # AVG on the exact path: Gloo's SUM divided by the world size.
    a = _input(rank, 8, torch.float64)
    b = a.clone()
    dist.all_reduce(a, op=dist.ReduceOp.AVG, group=cgx_group)
    dist.all_reduce(b, group=gloo_group)
    out.append(("float64", "AVG", 8, torch.equal(a, b / world)))
    # allreduce_coalesced of a small tensor and a compressible one: one compressed call in
    # which the small tensor travels unquantized, summed in float32 in rank order (SRA).
    small, big = _input(rank, 10, torch.float32), _input(rank, 4096, torch.float32)
    ref_small, ref_big = small.clone(), big.clone()
    dist.all_reduce_coalesced([small, big], group=cgx_group)
    dist.all_reduce_coalesced([ref_small, ref_big], group=gloo_group)
    if bits == 32:
        coalesced_ok = torch.equal(small, ref_small) and torch.equal(big, ref_big)
    else:
        in_rank_order = torch.zeros(10)
        for r in range(world):
            in_rank_order += _input(r, 10, torch.float32)
        bound = allreduce_error_bound([_input(r, 4096, torch.float32) for r in range(world)], bits)
        coalesced_ok = torch.equal(small, in_rank_order) and float((big - ref_big).abs().max()) <= bound
    out.append(("small+big", "coalesced", 4106, bool(coalesced_ok)))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bits", [4, 32])
def test_exact_allreduce_matches_gloo(world, bits):
    for rank_result in values(run_ranks(_exact_allreduce, world, args=(bits,))):
        failed = [case for case in rank_result if not case[-1]]
        assert not failed, f"differs from Gloo: {failed}"


def _other_collectives(rank, world):
    cgx_group, gloo_group = _pair(rank, world, 4)
    results = {}

    def both(name, fn):
        try:
            expected = fn(gloo_group)
        except RuntimeError as e:
            # Gloo of an older torch lacks some (torch 2.11: no list all_to_all): cgx,
            # which forwards to Gloo, must refuse it alike.
            if "does not support" not in str(e):
                raise
            try:
                fn(cgx_group)
                results[name] = False
            except RuntimeError as cgx_error:
                results[name] = str(cgx_error) == str(e)
            return
        results[name] = fn(cgx_group) == expected

    def digest(tensors):
        return [t.tolist() for t in tensors]

    x = _input(rank, 6 * world, torch.float32)

    def broadcast(g):
        t = x.clone()
        dist.broadcast(t, src=world - 1, group=g)
        return digest([t])

    def all_gather(g):
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x, group=g)
        return digest(out)

    def all_gather_into_tensor(g):
        out = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(out, x, group=g)
        return digest([out])

    def reduce_scatter(g):
        out = torch.empty(6)
        dist.reduce_scatter(out, list(x.chunk(world)), group=g)
        return digest([out])

    def reduce_scatter_tensor(g):
        out = torch.empty(6)
        dist.reduce_scatter_tensor(out, x, group=g)
        return digest([out])

    def all_to_all_single(g):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=g)
        return digest([out])

    def all_to_all(g):
        out = [torch.empty(6) for _ in range(world)]
        dist.all_to_all(out, list(x.chunk(world)), group=g)
        return digest(out)

    def gather(g):
        out = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
        dist.gather(x, out, dst=0, group=g)
        return digest(out or [])

    def scatter(g):
        out = torch.empty(6)
        dist.scatter(out, list(x.chunk(world)) if rank == 0 else None, src=0, group=g)
        return digest([out])

    def reduce(g):
        t = x.clone()
        dist.reduce(t, dst=1, group=g)
        return digest([t]) if rank == 1 else []

    def send_recv(g):
        t = x.clone()
        if rank == 0:
            dist.send(t, dst=world - 1, group=g)
        elif rank == world - 1:
            dist.recv(t, src=0, group=g)
        return digest([t])

    def barrier(g):
        dist.barrier(group=g)
        return "ok"

    for fn in (broadcast, all_gather, all_gather_into_tensor, reduce_scatter,
               reduce_scatter_tensor, all_to_all_single, all_to_all, gather, scatter, reduce,
               send_recv, barrier):
        both(fn.__name__, fn)
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_other_collectives_match_gloo(world):
    for rank_result in values(run_ranks(_other_collectives, world)):
        failed = [name for name, same in rank_result.items() if not same]
        assert not failed, f"differ from Gloo: {failed}"


def _per_call_exact(rank, world):
    """cgx.exact() on a group that compresses: what is issued in the block equals Gloo;
    what is issued outside it, or by another thread meanwhile, is still compressed."""
    import threading

    import cgx

    cgx_group, gloo_group = _pair(rank, world, 4)
    x = _input(rank, 100_000, torch.float32)
    ref = x.clone()
    dist.all_reduce(ref, group=gloo_group)
    out = {}
    lossy = x.clone()
    dist.all_reduce(lossy, group=cgx_group)
    out["compressed before the block"] = not torch.equal(lossy, ref)
    calls = cgx.stats()["calls"]
    other = x.clone()
    with cgx.exact():
        inside = x.clone()
        dist.all_reduce(inside, group=cgx_group)
        with cgx.exact():  # blocks nest; leaving the inner one keeps the outer
            pass
        avg = x.clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=cgx_group)
        pending = x.clone()
        work = dist.all_reduce(pending, group=cgx_group, async_op=True)
        half, ref_half = x.half(), x.half()
        dist.all_reduce(half, group=cgx_group)
        dist.all_reduce(ref_half, group=gloo_group)
        pair, ref_pair = [x[:500].clone(), x.clone()], [x[:500].clone(), x.clone()]
        dist.all_reduce_coalesced(pair, group=cgx_group)
        dist.all_reduce_coalesced(ref_pair, group=gloo_group)
        thread = threading.Thread(target=dist.all_reduce, args=(other,), kwargs={"group": cgx_group})
        thread.start()
        thread.join()
    work.wait()
    out["exact in the block"] = torch.equal(inside, ref)
    out["AVG in the block"] = torch.equal(avg, ref / world)
    out["async in the block"] = torch.equal(pending, ref)
    out["float16 in the block"] = torch.equal(half, ref_half)
    out["coalesced in the block"] = all(map(torch.equal, pair, ref_pair))
    out["another thread still compresses"] = torch.equal(other, lossy)
    out["one compressed call in the block (the thread's)"] = cgx.stats()["calls"] == calls + 1
    after = x.clone()
    dist.all_reduce(after, group=cgx_group)
    out["compressed after the block"] = torch.equal(after, lossy)
    return out


def test_per_call_exact_equals_gloo():
    for rank_result in values(run_ranks(_per_call_exact, 2)):
        failed = [name for name, ok in rank_result.items() if not ok]
        assert not failed, failed


def _exact_reasons(rank, world):
    """One allreduce of each kind that goes the exact way, and one compressed; the stats
    after each."""
    import cgx

    cgx_group, _ = _pair(rank, world, 4)
    seen = []

    def call(make, **kwargs):
        dist.all_reduce(make(), group=cgx_group, **kwargs)
        stats = cgx.stats()
        seen.append((stats["exact_calls"], stats["exact_bytes"], stats["exact_why"]))

    call(lambda: torch.ones(100_000))  # compressed
    call(lambda: torch.ones(100_000, dtype=torch.float64))
    call(lambda: torch.ones(100_000), op=dist.ReduceOp.MAX)
    call(lambda: torch.ones(16))
    with cgx.exact():
        call(lambda: torch.ones(100_000))
    dist.all_reduce_coalesced([torch.ones(10, dtype=torch.int32), torch.ones(20, dtype=torch.int32)], group=cgx_group)
    stats = cgx.stats()
    seen.append((stats["exact_calls"], stats["exact_bytes"], stats["exact_why"]))
    unquantized = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=32))
    dist.all_reduce(torch.ones(100_000), group=unquantized)
    return seen, stats["calls"], cgx.stats(unquantized)["exact_why"]


def test_the_stats_say_which_allreduces_went_exactly_and_why():
    for seen, compressed_calls, unquantized in values(run_ranks(_exact_reasons, 2)):
        assert compressed_calls == 1
        assert unquantized == {"bits": {"calls": 1, "bytes": 400_000}}
        assert seen[0] == (0, 0, {})
        assert seen[1] == (1, 800_000, {"dtype": {"calls": 1, "bytes": 800_000}})
        assert seen[2][2]["op"] == {"calls": 1, "bytes": 400_000}
        assert seen[3][2]["minimal_size"] == {"calls": 1, "bytes": 64}
        assert seen[4][2]["cgx.exact"] == {"calls": 1, "bytes": 400_000}
        assert seen[5][2]["dtype"] == {"calls": 2, "bytes": 800_120}
        assert seen[5][:2] == (5, 800_000 + 400_000 + 64 + 400_000 + 120)


def _complex(rank, world):
    """Complex tensors reach the backend as float views (view_as_real): still exact."""
    cgx_group, gloo_group = _pair(rank, world, 2)
    g = torch.Generator().manual_seed(rank)
    out = {}
    for dtype in (torch.complex64, torch.complex128):
        x = torch.randn(10_000, dtype=dtype, generator=g)
        mine, ref = x.clone(), x.clone()
        dist.all_reduce(mine, group=cgx_group)
        dist.all_reduce(ref, group=gloo_group)
        pair, ref_pair = [x.clone(), x[:100].clone()], [x.clone(), x[:100].clone()]
        dist.all_reduce_coalesced(pair, group=cgx_group)
        dist.all_reduce_coalesced(ref_pair, group=gloo_group)
        out[str(dtype)] = torch.equal(mine, ref) and all(map(torch.equal, pair, ref_pair))
    return out


def test_complex_allreduce_is_exact():
    for rank_result in values(run_ranks(_complex, 2)):
        assert all(rank_result.values()), rank_result


def _sparse(rank, world):
    """Sparse COO allreduce takes the exact path, as Gloo reduces it, on a compressing
    group; every rank ends with the same sum."""
    cgx_group, gloo_group = _pair(rank, world, 4)
    g = torch.Generator().manual_seed(rank)
    indices = torch.tensor([[rank, 5, 7 + rank, 5]])
    sparse = torch.sparse_coo_tensor(indices, torch.randn(4, 64, generator=g), (20, 64))
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        mine, ref = sparse.clone(), sparse.clone()
        dist.all_reduce(mine, op=op, group=cgx_group)
        dist.all_reduce(ref, group=gloo_group)  # Gloo's sparse allreduce has SUM only
        if op == dist.ReduceOp.AVG:
            ref = ref / world
        out[str(op)] = (mine.is_sparse, torch.equal(mine.to_dense(), ref.to_dense()))
    everyone = [torch.empty(20, 64) for _ in range(world)]
    dist.all_gather(everyone, mine.to_dense(), group=gloo_group)
    out["same on every rank"] = all(torch.equal(everyone[0], e) for e in everyone)
    return out


def test_sparse_allreduce_equals_gloo():
    for rank_result in values(run_ranks(_sparse, 2)):
        assert rank_result.pop("same on every rank")
        for op, (is_sparse, same) in rank_result.items():
            assert is_sparse and same, op
