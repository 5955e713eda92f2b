"""CGX_COMPRESSION_AUTO over real ranks: every rank sends each call the same way, the
results are bit-identical whichever way a call went, a call sent exactly is exact (its
error-feedback residual spent), ranks given different calls get CallMismatchError
whichever way the call would go, 16-bit averages do not overflow on either way, and
cgx.stats() shows the choices. The choices themselves (the slowest rank's timings,
re-tries) are tested in tests/cpp/test_path_choice.cpp."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bounds import allreduce_error_bound
from harness import init_cgx, run_ranks, values

CALLS = 40  # the first 3 calls of a class are compressed, the next 3 exact, then the faster way


def _path_of_last_call(group) -> str:
    import cgx

    (entry,) = cgx.stats(group)["auto"]
    return entry["path"]


def _allreduces(rank, world, auto, n):
    import cgx

    init_cgx(rank, world)
    # The bound below is the maxmin scheme's (tests/bounds.py); auto chooses alike in either.
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, scheme="maxmin", minimal_size=0,
                                                               compression_auto=auto))
    out = []
    for call in range(CALLS):
        # Integers: their exact sum is exact in float32.
        inputs = [torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(call * world + r))
                  .float() for r in range(world)]
        t = inputs[rank].clone()
        work = dist.all_reduce(t, group=group, async_op=True)
        work.wait()
        path = _path_of_last_call(group) if auto else "compressed"
        assert cgx._C.sent_exactly(work) == (path == "exact")
        exact = torch.stack(inputs).sum(0)
        error = float((t - exact).abs().max())
        out.append((path, t, error, allreduce_error_bound(inputs, 4)))
    return out, cgx.stats(group)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_takes_the_same_path_and_ends_bit_identical(world):
    results = values(run_ranks(_allreduces, world, args=(True, 5000)))
    per_rank = [calls for calls, _ in results]
    paths = [[path for path, *_ in calls] for calls in per_rank]
    assert all(p == paths[0] for p in paths)
    # Measured first compressed, then exact, a run of each (the choices that follow are
    # tested in tests/cpp/test_path_choice.cpp).
    assert paths[0][:6] == ["compressed"] * 3 + ["exact"] * 3
    for call in range(CALLS):
        tensors = [calls[call][1] for calls in per_rank]
        assert all(torch.equal(t, tensors[0]) for t in tensors), f"call {call}"
        path, _, error, bound = per_rank[0][call]
        if path == "exact":
            assert error == 0, f"call {call} went the exact way but is off by {error}"
        else:
            assert 0 < error <= bound, f"call {call}: error {error}, bound {bound}"
    stats = [s for _, s in results]
    assert all(s["auto"] == stats[0]["auto"] for s in stats)  # timings agreed too
    (entry,) = stats[0]["auto"]
    assert entry["min_bytes"] == 16384  # 5000 float32 values: [16 KiB, 32 KiB)
    assert entry["compressed_calls"] + entry["exact_calls"] == CALLS
    assert entry["compressed_ms"] > 0 and entry["exact_ms"] > 0
    # Both ways are counted in the allreduce totals, with the bytes each really sent: the
    # exact way 4 bytes a value (2 ranks: SRA sends half the values twice).
    assert stats[0]["calls"] == CALLS
    # Auto's exact calls, and only those, said as such (4 bytes a value of the caller's tensor).
    assert stats[0]["exact_calls"] == entry["exact_calls"] >= 3
    assert stats[0]["exact_why"] == {"auto": {"calls": entry["exact_calls"], "bytes": entry["exact_calls"] * 4 * 5000}}
    assert stats[0]["exact_bytes"] == entry["exact_calls"] * 4 * 5000
    if world == 2:
        per_exact_call = 4 * 5000
        compressed_bytes = stats[0]["bytes_sent"] - entry["exact_calls"] * per_exact_call
        assert 0 < compressed_bytes < entry["compressed_calls"] * per_exact_call / 4


def test_with_auto_off_every_call_is_compressed():
    results = values(run_ranks(_allreduces, 2, args=(False, 5000)))
    for calls, stats in results:
        assert stats["auto"] == []
        assert stats["calls"] == CALLS
        assert stats["exact_calls"] == stats["exact_bytes"] == 0 and stats["exact_why"] == {}
        assert all(0 < error <= bound for _, _, error, bound in calls)


def _layout_calls(rank, world):
    """allreduce_layout with an error-feedback residual until a call goes the exact way:
    that call must be exact on input + residual and leave the residual spent."""
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=2, minimal_size=0))
    backend = cgx.get_backend()
    n = 3000
    residual = torch.zeros(n)
    for call in range(CALLS):
        # A transposed view (not contiguous): the residual's order is the tensor's own.
        inputs = [torch.randint(-100, 100, (50, 60), generator=torch.Generator().manual_seed(call * world + r))
                  .float().t() for r in range(world)]
        carried = residual.clone()
        t = inputs[rank].clone().t().contiguous().t()
        assert not t.is_contiguous()
        backend.allreduce_layout(t, [(0, n, 2, 512)], residual=residual).wait()
        if _path_of_last_call(None) == "exact":
            return call, t.reshape(-1), carried, residual, torch.stack(inputs).sum(0).reshape(-1)
        assert residual.abs().max() > 0  # a 2-bit call drops something
    raise AssertionError("no call went the exact way")


def test_a_call_sent_exactly_spends_the_error_feedback_residual():
    results = values(run_ranks(_layout_calls, 2))
    assert results[0][0] == results[1][0]  # the same call, on both ranks
    carried_sum = sum(carried for _, _, carried, _, _ in results)
    for _, t, _, residual, exact in results:
        # Exact on the inputs plus what the ranks carried (integers plus float residuals:
        # summed in another order than here, so within float32 rounding).
        torch.testing.assert_close(t, exact + carried_sum, rtol=0, atol=1e-4)
        assert torch.equal(residual, torch.zeros_like(residual))
    assert torch.equal(results[0][1], results[1][1])


def _ddp_hook_with_auto(rank, world):
    """The DDP hook on a group with auto on, static graph and buckets as gradient views:
    buckets go both ways over the run, the replicas stay bit-identical after every step."""
    import cgx
    from test_hooks import make_model, train
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_cgx(rank, world, pg_options=cgx.Config(minimal_size=0))  # auto is on by default
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.002, static_graph=True, gradient_as_bucket_view=True)
    state = cgx.CGXState(None, compression_params={"bits": 4, "bucket_size": 128}, layer_min_size=16,
                         warmup_steps=0)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    _, same = train(ddp, model, rank, 30, check_every_step=True)
    return same, cgx.stats()["auto"]


def test_ddp_hook_buckets_go_both_ways_and_replicas_stay_identical():
    results = values(run_ranks(_ddp_hook_with_auto, 2))
    for same, auto in results:
        assert same
        assert auto == results[0][1]
        assert sum(e["exact_calls"] for e in auto) > 0 and sum(e["compressed_calls"] for e in auto) > 0


def _mismatches_on_every_path(rank, world, inner):
    """Ranks given different calls, between matching calls that go both ways: each
    mismatch raises CallMismatchError on every rank whichever way auto would send it (the
    way is chosen only once the call is agreed), and leaves the group and auto's choices
    as they were. The exact way is cgx's raw allreduce over shared memory, Gloo's
    otherwise."""
    import cgx

    init_cgx(rank, world)
    group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, minimal_size=0, compression_auto=True,
                                                               inner_communicator=inner))
    mismatches = {
        # The same byte size, another dtype: summed as is, the ranks would disagree.
        "dtype": lambda: torch.full((200,), 1.5, dtype=torch.float16) if rank == 0
        else torch.full((200,), 2.5, dtype=torch.bfloat16),
        "shape": lambda: torch.ones(4, 50) if rank == 0 else torch.ones(50, 4),
        "size": lambda: torch.ones(200) if rank == 0 else torch.ones(210),
        # A class that has gone both ways against one that has had no call.
        "class": lambda: torch.ones(200) if rank == 0 else torch.ones(5000),
    }
    messages, paths = [], []
    for call in range(14):
        for name, make in mismatches.items():
            try:
                dist.all_reduce(make(), group=group)
                messages.append((call, name, None))
            except cgx.CallMismatchError as e:
                messages.append((call, name, str(e)))
        t = torch.ones(200)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((200,), float(world))), t[:4]
        paths.append(_path_of_last_call(group))  # one class only: mismatches chose nothing
    return messages, paths


@pytest.mark.parametrize("inner", ["SHM", "GLOO"])
def test_a_mismatch_raises_on_every_rank_whichever_way_auto_sends_the_call(inner):
    results = values(run_ranks(_mismatches_on_every_path, 2, args=(inner,), timeout_s=120))
    (messages0, paths), (messages1, paths1) = results
    assert paths == paths1
    assert "exact" in paths and "compressed" in paths
    assert messages0 == messages1  # the same message on every rank
    for call, name, message in messages0:
        assert message is not None, f"call {call}: the {name} mismatch did not raise"
        assert "ranks were given different calls" in message, (name, message)


def _overflowing_averages(rank, world, inner):
    """16-bit values whose sum leaves their range, or whose sum leaves float32's, on
    every way a call can go (auto's two ways, cgx.exact())."""
    import cgx

    init_cgx(rank, world)
    out = []
    # (dtype, a value whose AVG must come back unchanged, a value whose SUM overflows):
    # float16's sum leaves float16's range; bfloat16's, float32's (it is summed there).
    for dtype, average, overflow in ((torch.float16, 40000.0, 40000.0), (torch.bfloat16, 2.0 ** 126, 2.0 ** 127)):
        # A group per dtype: its calls make one size class that goes both ways.
        group = dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4, minimal_size=0, compression_auto=True,
                                                                   inner_communicator=inner))
        for call in range(20):
            for op, value in ((dist.ReduceOp.AVG, average), (dist.ReduceOp.SUM, overflow)):
                t = torch.full((200,), value, dtype=dtype)
                dist.all_reduce(t, op=op, group=group)
                out.append((dtype, op, value, _path_of_last_call(group), t))
        for op, value in ((dist.ReduceOp.AVG, average), (dist.ReduceOp.SUM, overflow)):
            t = torch.full((200,), value, dtype=dtype)
            with cgx.exact():
                dist.all_reduce(t, op=op, group=group)
            out.append((dtype, op, value, "cgx.exact()", t))
    return out


@pytest.mark.parametrize("inner", ["SHM", "GLOO"])
def test_16_bit_averages_do_not_overflow_on_any_path(inner):
    for out in values(run_ranks(_overflowing_averages, 2, args=(inner,), timeout_s=120)):
        for dtype in (torch.float16, torch.bfloat16):
            taken = {path for d, _, _, path, _ in out if d == dtype}
            assert taken == {"exact", "compressed", "cgx.exact()"}, (dtype, taken)
        for dtype, op, value, path, t in out:
            if op == dist.ReduceOp.AVG:
                assert torch.equal(t, torch.full_like(t, value)), (dtype, path, t[:4])
            elif dtype == torch.float16:  # summed in float32, rounded once: +Inf on every way
                assert torch.equal(t, torch.full_like(t, float("inf"))), (dtype, path, t[:4])
            else:  # beyond float32: Inf, or NaN where a quantized bucket holds it
                assert not torch.isfinite(t).any(), (dtype, path, t[:4])


def _hook_counts_what_was_sent(rank, world):
    """Two warm-up steps (exact), then a class's first three calls are compressed and its
    fourth goes the exact way, whatever the timings: the hook's payload count follows the
    way each bucket went, and its stats say which went exactly and why."""
    import cgx
    from test_hooks import make_model, train
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_cgx(rank, world, pg_options=cgx.Config(minimal_size=0))  # auto is on by default
    model = make_model()
    ddp = DDP(model)  # one bucket
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4), warmup_steps=2)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    sent = []
    for step in range(6):
        train(ddp, model, rank, 1, start=step)
        sent.append(state.stats()["payload_bytes"])
    numel = sum(p.numel() for p in model.parameters())
    backend = cgx.stats()
    (entry,) = backend["auto"]
    return sent, numel, entry["compressed_calls"], entry["exact_calls"], state.stats(), backend["exact_why"]


def test_the_hook_counts_a_bucket_sent_exactly_as_float32_and_says_why():
    for sent, numel, compressed_calls, exact_calls, stats, backend_why in values(
            run_ranks(_hook_counts_what_was_sent, 2)):
        assert (compressed_calls, exact_calls) == (3, 1)
        assert sent[:2] == [4 * numel, 8 * numel]  # the warm-up's all-raw plan
        compressed = sent[2] - sent[1]
        assert 0 < compressed < numel  # 4 bits: about an eighth of float32
        assert sent[2:5] == [8 * numel + compressed * (step + 1) for step in range(3)]
        assert sent[5] - sent[4] == 4 * numel
        assert stats["exact_why"] == {"warmup": {"calls": 2, "bytes": 8 * numel},
                                      "auto": {"calls": 1, "bytes": 4 * numel}}
        assert (stats["exact_calls"], stats["exact_bytes"]) == (3, 12 * numel)
        assert backend_why == {"auto": {"calls": 1, "bytes": 4 * numel}}  # the backend's count of the same call
