"""Bad input and faults: a clear exception on every rank, within the timeout, never a
hang or garbage; the group stays usable after a rejected call. Groups that check that
quantize in maxmin, which brings a constant input back exactly, so the check is bit for
bit (the hadamard scheme errs on it by a few percent)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankError, init_cgx, process_gone, run_ranks, values


def _mismatched_sizes(rank, world):
    import cgx

    init_cgx(rank, world, timeout_s=30, pg_options=cgx.Config(bits=4, scheme="maxmin"))
    t = torch.randn(1000 + (rank == world - 1) * 24)
    try:
        dist.all_reduce(t)
        first = "no error"
    except cgx.CallMismatchError as e:
        # torch's own type for a backend's failure, so `except DistBackendError` works
        assert isinstance(e, dist.DistBackendError) and isinstance(e, RuntimeError)
        first = str(e)
    # Rejected before any data moved: the group still works.
    ok = torch.ones(5000)
    dist.all_reduce(ok)
    return first, bool((ok == world).all())


@pytest.mark.parametrize("world", [2, 3])
def test_different_sizes_raise_call_mismatch_on_every_rank(world):
    for message, still_works in values(run_ranks(_mismatched_sizes, world)):
        assert "ranks were given different calls" in message
        assert "1000 elements" in message and "1024 elements" in message
        assert still_works


def _different_calls(rank, world):
    """Ranks given different calls, on every path: each rank raises naming what differs,
    before any data moves, and the group stays usable (exact and compressed calls after
    it are right)."""
    import cgx

    init_cgx(rank, world, timeout_s=30, pg_options=cgx.Config(bits=4, scheme="maxmin", minimal_size=16))
    backend = cgx.get_backend()
    first = rank == 0
    calls = {
        # A small and a large tensor against one of their total size: Gloo pairs the
        # small one with a later call if it is split off.
        "mixed coalesced": lambda: dist.all_reduce_coalesced(
            [torch.ones(100), torch.full((10,), 100.0)] if first else [torch.ones(110)]),
        "small tensors coalesced": lambda: dist.all_reduce_coalesced(
            [torch.ones(10)] * 11 if first else [torch.ones(110)]),
        "dtype": lambda: dist.all_reduce(torch.ones(1000, dtype=torch.float32 if first else torch.float16)),
        "plan bits": lambda: backend.allreduce_layout(
            torch.ones(1000), [(0, 1000, 4 if first else 8, 512)]).wait(),
        "raw plan against a compressed one": lambda: backend.allreduce_layout(
            torch.ones(1000), [(0, 1000, 32 if first else 4, 512)]).wait(),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            message = "no error"
        except cgx.CallMismatchError as e:
            message = str(e)
        exact, compressed = torch.ones(10), torch.ones(1000)
        dist.all_reduce(exact)
        dist.all_reduce(compressed)
        out[name] = (message, bool((exact == world).all()), bool((compressed == world).all()))
    return out


def test_different_calls_on_every_path_raise_and_leave_the_group_usable():
    expected = {
        "mixed coalesced": ("tensors of shapes [100], [10]", "tensors of shapes [110]"),
        "small tensors coalesced": ("tensors of shapes [10], [10], [10]", "...", "[110]"),
        "dtype": ("dtype Float", "dtype Half"),
        "plan bits": ("the per-layer plan 1000:4b/512", "the per-layer plan 1000:8b/512"),
        "raw plan against a compressed one": ("the per-layer plan 1000:raw", "the per-layer plan 1000:4b/512"),
    }
    for out in values(run_ranks(_different_calls, 2)):
        for name, (message, exact_ok, compressed_ok) in out.items():
            assert "ranks were given different calls" in message, (name, message)
            for part in expected[name]:
                assert part in message, (name, message)
            assert exact_ok and compressed_ok, name


def _disagreed_calls_keep_the_residuals(rank, world):
    """A call with an error-feedback residual folds it into its values and rewrites it as
    its first pieces are encoded: a call the ranks disagree on must leave it, and an
    in-place input, as they were, bit for bit (qsdp keeps its residuals in the tensors it
    passes). Values that cancel (a residual 10^8 times an input value) would show a restore
    by subtraction."""
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=4, scheme="maxmin", minimal_size=16, compression_auto=False))
    backend = cgx.get_backend()
    n = 4096
    plan = [(0, n, 8 if rank == 1 else 4, 512)]  # rank 1's plan differs
    generator = torch.Generator().manual_seed(rank)
    errors, kept = [], []
    x = torch.randn(n, generator=generator) * 1e-6
    residual = torch.randn(n, generator=generator) * 100
    before = x.clone(), residual.clone()
    try:
        backend.allreduce_layout(x, plan, residual=residual).wait()
    except cgx.CallMismatchError as e:
        errors.append(str(e))
    kept.append(torch.equal(x, before[0]) and torch.equal(residual, before[1]))
    shard_plan = [(0, n // world, 8 if rank == 1 else 4, 512)]
    x = torch.randn(n, generator=generator)
    residual = torch.randn(n, generator=generator) * 100
    before = x.clone(), residual.clone()
    try:
        backend.reduce_scatter_layout(torch.empty(n // world), x, shard_plan, op="sum", residual=residual).wait()
    except cgx.CallMismatchError as e:
        errors.append(str(e))
    kept.append(torch.equal(x, before[0]) and torch.equal(residual, before[1]))
    return errors, kept


def test_a_call_the_ranks_disagree_on_leaves_its_residual_as_it_was():
    for errors, kept in values(run_ranks(_disagreed_calls_keep_the_residuals, 2)):
        assert len(errors) == 2 and all("the per-layer plan" in e for e in errors), errors
        assert kept == [True, True]


def _paths_split(rank, world):
    """One rank's tensor is at or under minimal_size (exact, through Gloo), the other's
    is compressed: both raise, and the next compressed call cannot pair up with the
    stale half of the failed one (it raises too, or is right): never garbage."""
    import cgx

    init_cgx(rank, world, timeout_s=5, pg_options=cgx.Config(bits=4, minimal_size=16))
    t = torch.randn(10 if rank == 0 else 1000)
    try:
        dist.all_reduce(t)
        first = "no error"
    except RuntimeError as e:
        first = f"{type(e).__name__}: {e}"
    later = []
    # A compressed call, then an exact one of the size rank 0's stale Gloo call has.
    for ok in (torch.ones(1000), torch.ones(10)):
        try:
            dist.all_reduce(ok)
            later.append("right" if bool((ok == world).all()) else f"garbage: {ok[:4].tolist()}")
        except RuntimeError as e:
            later.append(f"{type(e).__name__}: {e}")
    return first, later


def test_ranks_on_different_paths_raise_never_garbage():
    results = values(run_ranks(_paths_split, 2, timeout_s=120))
    for first, later in results:
        assert first != "no error"
        assert not any(m.startswith("garbage") for m in later), later
    # Rank 1's compressed calls time out (or, racing rank 0's next call, fail its
    # signature check first, or meet rank 0 gone: it shut its group down at its end): the
    # failure marks its group failed, so its exact call after raises at once instead of
    # reaching Gloo. The refusal has the type of the failure that caused it.
    assert "unusable after an earlier failure" in results[1][1][-1], results[1][1]
    cause = results[1][1][0].split(":")[0]
    assert cause in ("CollectiveTimeoutError", "CallMismatchError") or (
        cause == "PeerError" and "left the group (shut it down)" in results[1][1][0]), results[1][1]
    assert results[1][1][-1].startswith(cause + ":"), results[1][1]
    assert results[0][1][-1] != "right", results[0][1]


def _bad_tensors(rank, world):
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=4, scheme="maxmin", minimal_size=0))
    out = {}
    # Sparse COO is reduced exactly (test_exact); CSR is refused by torch's dispatcher
    # before any backend sees it, for Gloo alike.
    csr = torch.randn(100, 100).to_sparse_csr()
    try:
        dist.all_reduce(csr)
        out["csr"] = "no error"
    except RuntimeError as e:
        out["csr"] = str(e)
    empty = torch.empty(0)
    dist.all_reduce(empty)
    out["empty"] = empty.numel()
    # Non-contiguous input is reduced in place through its view.
    base = torch.ones(300, 300)
    view = base[:, ::3]
    dist.all_reduce(view)
    out["strided"] = bool((view == world).all()) and bool((base[:, 1] == 1).all())
    try:
        dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG)
        out["int_avg"] = "no error"
    except (RuntimeError, ValueError) as e:
        out["int_avg"] = str(e)
    return out


def test_csr_empty_strided_and_bad_op():
    for r in values(run_ranks(_bad_tensors, 2)):
        assert "SparseCsr" in r["csr"]
        assert r["empty"] == 0
        assert r["strided"]
        assert "AVG needs floating-point" in r["int_avg"]


def _expanded_outputs(rank, world):
    """A tensor whose elements share memory (expand, stride 0) cannot take a result:
    refused on the caller's thread before anything moves, on the compressed and the
    exact path (where Gloo itself would crash), and the group stays usable."""
    import cgx

    init_cgx(rank, world, timeout_s=30, pg_options=cgx.Config(bits=4, scheme="maxmin", minimal_size=0))
    backend = cgx.get_backend()
    expanded = lambda: torch.ones(1).expand(10_000)  # noqa: E731
    calls = {
        "compressed allreduce": lambda: dist.all_reduce(expanded()),
        "exact allreduce": lambda: dist.all_reduce(expanded(), op=dist.ReduceOp.MAX),
        "allreduce_layout": lambda: backend.allreduce_layout(expanded(), [(0, 10_000, 4, 512)]).wait(),
        "broadcast": lambda: dist.broadcast(expanded(), src=0),
        "all_gather": lambda: dist.all_gather([expanded() for _ in range(world)], torch.ones(10_000)),
        "recv": lambda: dist.recv(expanded(), src=(rank + 1) % world),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    after = torch.ones(10_000)
    dist.all_reduce(after)  # compressed, and the group is still usable
    exact = torch.ones(10, dtype=torch.int64)
    dist.all_reduce(exact)
    return out, float(after[0]), exact.tolist()


def test_expanded_tensors_are_refused_and_the_group_stays_usable():
    for out, after, exact in values(run_ranks(_expanded_outputs, 2)):
        for name, message in out.items():
            assert "share memory (an expanded or stride-0 view)" in message, (name, message)
        assert abs(after - 2.0) < 0.1 and exact == [2] * 10


def _init_only(rank, world):
    init_cgx(rank, world)
    return "initialized"


@pytest.mark.parametrize(
    "variable, value",
    [
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "12abc"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "0"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "-4"),
        ("CGX_INNER_REDUCTION_TYPE", "tree"),
        ("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "maybe"),
    ],
)
def test_bad_environment_value_raises_value_error_at_init(variable, value):
    for r in run_ranks(_init_only, 2, env={variable: value}):
        assert isinstance(r, RankError) and r.type == "ValueError", r
        assert variable in r.message and repr(value) in r.message


def _init_with_bad_value_on_rank_1(rank, world):
    if rank == 1:
        os.environ["CGX_COMPRESSION_BUCKET_SIZE"] = "12abc"
    start = time.monotonic()
    try:
        init_cgx(rank, world, timeout_s=60)
        return "initialized"
    except ValueError as e:
        return str(e), time.monotonic() - start


def test_bad_environment_value_on_one_rank_raises_on_every_rank_fast():
    for message, elapsed in values(run_ranks(_init_with_bad_value_on_rank_1, 3)):
        assert message.startswith("cgx: bad configuration on rank 1: CGX_COMPRESSION_BUCKET_SIZE='12abc'"), message
        assert elapsed < 20, elapsed  # not the 60 s timeout


SET_UP_TIMEOUT_S = 3


def _killed_in_set_up(rank, world, how):
    """Rank 0 is killed (signal `how`) as it starts to wait in the shared-memory set-up
    for rank 1: right after it announced its own segment. Rank 1 announces its segment
    only once rank 0 is dead. Both orders are events, not times."""
    import signal

    import cgx

    class SetUpStore(dist.Store):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def set(self, key, value):
            if "/created/" in key and rank == 1:  # late: after rank 0 is gone
                pid = int(self.inner.get("test/pid/0"))
                while not process_gone(pid):
                    time.sleep(0.01)
            self.inner.set(key, value)
            if "/created/" in key and rank == 0:  # its segment exists and is announced: it waits now
                os.kill(os.getpid(), getattr(signal, how))

        def get(self, key):
            return self.inner.get(key)

    construct = cgx._C.ProcessGroupCGX

    def watched(store, *args):
        store.set(f"test/pid/{rank}", str(os.getpid()))
        return construct(SetUpStore(store), *args)

    cgx._C.ProcessGroupCGX = watched
    start = time.monotonic()
    try:
        init_cgx(rank, world, timeout_s=SET_UP_TIMEOUT_S, pg_options=cgx.Config(bits=4))
        return "no error"
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return str(e), time.monotonic() - start
    finally:
        cgx._C.ProcessGroupCGX = construct




@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_rank_killed_in_set_up_leaves_nothing_in_dev_shm(how):
    # run_ranks fails on anything left in /dev/shm: SIGTERM unlinks the dying rank's
    # segment on its way out; after SIGKILL the survivor removes it.
    results = run_ranks(_killed_in_set_up, 2, args=(how,), expect_exit={0}, timeout_s=60)
    assert results[0] is None
    message, elapsed = values(results)[1]
    assert "dead or stalled in set-up?" in message, message
    if how == "SIGTERM":  # rank 0 removed its segment on the way out
        assert "cgx shm: rank 0 has no shared memory to open" in message, message
    else:  # rank 0's segment outlived it; rank 1 waited for it, then removed it
        assert "cgx shm: rank 0 has not opened the others' shared memory in time" in message, message
    assert elapsed < 30, elapsed  # the set-up's timeout (3 s), not the run's limit (60 s)


def _dies_mid_collective(rank, world, timeout_s):
    import cgx

    init_cgx(rank, world, timeout_s=timeout_s, pg_options=cgx.Config(bits=4, shm_ring_bytes=65536))
    t = torch.randn(4_000_000)
    dist.all_reduce(t)  # a healthy call first
    if rank == world - 1:
        dist.all_reduce(t, async_op=True)  # starts streaming, then the process vanishes
        os._exit(1)
    # The call matched with the dead rank's usually fails part-way; if that rank got
    # through it before dying, the next call must fail.
    outcome, elapsed = None, 0.0
    for _ in range(2):
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except (cgx.CollectiveTimeoutError, cgx.PeerError) as e:
            outcome, elapsed = (type(e).__name__, str(e)), time.monotonic() - start
            break
    try:  # later calls fail at once instead of waiting again, with the cause's type
        dist.all_reduce(t)
        later = None
    except (cgx.CollectiveTimeoutError, cgx.PeerError) as e:
        later = (type(e).__name__, str(e))
    return outcome, elapsed, later


@pytest.mark.parametrize("world", [2, 3])
def test_a_dead_local_peer_raises_peer_error_long_before_the_timeout(world):
    # Over shared memory: the dead process is seen through its pid (a pidfd), and a rank
    # that fails tells the peers that wait for it.
    timeout_s = 60.0
    results = run_ranks(_dies_mid_collective, world, args=(timeout_s,), expect_exit={world - 1})
    assert results[-1] is None
    for outcome, elapsed, later in values(results[:-1]):
        assert outcome is not None and later is not None, (outcome, later)
        assert outcome[0] == "PeerError", outcome
        assert elapsed < 5, elapsed
        assert later[0] == outcome[0] and "unusable after an earlier failure" in later[1], (outcome, later)


def _exact_calls_after_a_peer_died(rank, world):
    """Every exact call (Gloo underneath) on a group whose peer is gone, by what it raised."""
    import cgx

    init_cgx(rank, world, timeout_s=30, pg_options=cgx.Config(bits=4))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    dist.all_reduce(torch.ones(8, dtype=torch.int64))  # a healthy exact call first
    if rank == 1:
        os._exit(1)
    while not process_gone(pids[1]):
        time.sleep(0.01)
    calls = {
        "int64 allreduce": lambda: dist.all_reduce(torch.ones(8, dtype=torch.int64)),
        "float allreduce under minimal_size": lambda: dist.all_reduce(torch.ones(4)),
        "its future": lambda: dist.all_reduce(torch.ones(8, dtype=torch.int64), async_op=True).get_future().wait(),
        "send": lambda: dist.send(torch.ones(4), dst=1),
        "recv": lambda: dist.recv(torch.ones(4), src=1),
        "broadcast": lambda: dist.broadcast(torch.ones(4), src=0),
        "all_gather": lambda: dist.all_gather([torch.ones(4), torch.ones(4)], torch.ones(4)),
        "barrier": lambda: dist.barrier(),
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = "no error"
        except Exception as e:  # noqa: BLE001 (what it raised is the result)
            raised[name] = type(e).__name__
    return raised


def test_the_exact_path_raises_peer_error_for_a_dead_peer_like_every_path():
    results = run_ranks(_exact_calls_after_a_peer_died, 2, expect_exit={1})
    raised = values(results[:1])[0]
    assert raised == {name: "PeerError" for name in raised}, raised


def _a_peer_shuts_down_while_this_rank_waits(rank, world, path):
    """Rank 0 waits on rank 1 in a call rank 1 never makes; rank 1 shuts its group down
    (alive) once rank 0 is in the call. Then a call on rank 1's shut-down group."""
    import cgx

    init_cgx(rank, world, timeout_s=120, pg_options=cgx.Config(bits=4))
    store = dist.distributed_c10d._get_default_store()
    # Connected, both ways. Its handle is kept past the shutdown: it must not keep the
    # connections open, and still answers for the call.
    kept = dist.all_reduce(torch.ones(8, dtype=torch.int64), async_op=True)
    kept.wait()
    if rank == 1:
        backend = cgx.get_backend()
        store.wait(["in the call"])
        backend.shutdown()
        try:
            backend.allreduce([torch.ones(8)]).wait()
            after = "no error"
        except dist.DistBackendError as e:
            after = str(e)
        store.wait(["rank 0 done"])
        return after, kept.is_completed(), kept.get_future().value()[0].tolist()
    tensor = torch.ones(8, dtype=torch.int64) if path == "exact" else torch.ones(1 << 16)
    work = dist.all_reduce(tensor, async_op=True)
    store.set("in the call", "1")
    try:
        work.wait()
        raised = "no error"
    except Exception as e:  # noqa: BLE001 (what it raised is the result)
        raised = type(e).__name__
    store.set("rank 0 done", "1")
    return raised


@pytest.mark.parametrize("path", ["exact", "compressed"])
def test_a_peer_that_shuts_down_is_known_at_once_not_at_the_timeout(path):
    """A rank that shuts its group down (destroy_process_group, an elastic replica's
    leave()) closes its connections: a peer waiting on it gets a PeerError, where it would
    otherwise wait out the group's timeout (120 s here: a CollectiveTimeoutError)."""
    raised, (after, kept_completed, kept_value) = values(
        run_ranks(_a_peer_shuts_down_while_this_rank_waits, 2, args=(path,), timeout_s=100))
    assert raised == "PeerError"
    assert "unusable after an earlier failure: it was shut down on this rank" in after
    assert kept_completed and kept_value == [2] * 8


def _exact_call_past_the_timeout(rank, world, joined, released):
    """A caller's own short wait first (not a failure), then a wait past the group's
    timeout (one), then what later calls raise."""
    import datetime

    import cgx

    # The group's timeout leaves rank 1 time to join the first call after the short wait,
    # on a loaded machine too.
    init_cgx(rank, world, timeout_s=5, pg_options=cgx.Config(bits=4))
    dist.all_reduce(torch.ones(8, dtype=torch.int64))
    if rank == 1:  # joins the first call late; then makes no call until rank 0's have failed
        while not os.path.exists(joined):
            time.sleep(0.01)
        dist.all_reduce(torch.ones(8, dtype=torch.int64))
        dist.all_reduce(torch.ones(8, dtype=torch.int64))
        while not os.path.exists(released):
            time.sleep(0.01)
        return None
    pending = dist.all_reduce(torch.ones(8, dtype=torch.int64), async_op=True)
    try:
        pending.wait(timeout=datetime.timedelta(milliseconds=100))
        short = "no error"
    except Exception as e:  # noqa: BLE001 (what it raised is the result)
        short = type(e).__name__
    open(joined, "w").close()
    pending.wait()
    usable = torch.ones(8, dtype=torch.int64)
    dist.all_reduce(usable)  # the group still works
    start = time.monotonic()
    raised = []
    for call in (lambda: dist.all_reduce(torch.ones(8, dtype=torch.int64)),  # rank 1 makes no call
                 lambda: dist.all_reduce(torch.ones(8, dtype=torch.int64)),  # later: unusable at once
                 lambda: dist.all_reduce(torch.ones(1 << 16)),  # a compressed one too
                 lambda: dist.barrier()):
        try:
            call()
            raised.append(("no error", ""))
        except Exception as e:  # noqa: BLE001
            raised.append((type(e).__name__, str(e)))
    elapsed = time.monotonic() - start
    open(released, "w").close()
    return short, int(usable[0]), raised, elapsed


def test_an_exact_call_past_the_groups_timeout_raises_collective_timeout_error(tmp_path):
    """Gloo's timeout is a failure of the group, like a compressed call's (later calls of
    every kind raise its type at once); a caller's own shorter wait is not."""
    short, usable, raised, elapsed = values(run_ranks(
        _exact_call_past_the_timeout, 2, args=(str(tmp_path / "joined"), str(tmp_path / "released"))))[0]
    assert short == "RuntimeError" and usable == 2, (short, usable)
    assert [kind for kind, _ in raised] == ["CollectiveTimeoutError"] * 4, raised
    assert all("unusable after an earlier failure" in message for _, message in raised[1:]), raised
    assert elapsed < 20, elapsed


def _mismatched_settings(rank, world):
    import cgx

    init_cgx(rank, world, pg_options=cgx.Config(bits=4 if rank == 0 else 8))
    return "initialized"


def test_ranks_with_different_settings_fail_at_creation():
    for r in run_ranks(_mismatched_settings, 3):
        assert isinstance(r, RankError) and r.type == "ValueError", r
        assert "disagree on CGX_COMPRESSION_QUANTIZATION_BITS" in r.message
        assert "rank 0 has 4, rank 1 has 8" in r.message


def _high_tag(rank, world):
    init_cgx(rank, world)
    try:
        if rank == 0:
            dist.send(torch.ones(2), dst=1, tag=1 << 30)
        else:
            dist.recv(torch.ones(2), src=0, tag=1 << 30)
        return "no error"
    except ValueError as e:
        return str(e)


def test_user_tags_in_cgx_range_are_rejected():
    for message in values(run_ranks(_high_tag, 2)):
        assert "tags must be in 0.." in message


def _dies_across_hosts(rank, world):
    """One rank per emulated host: the compressed allreduce crosses through Gloo, whose
    connection to a killed peer closes."""
    import cgx

    init_cgx(rank, world, timeout_s=20, pg_options=cgx.Config(bits=4, hostname=f"host{rank}",
                                                              cross_communicator="GLOO"))
    t = torch.randn(1 << 20)
    dist.all_reduce(t)  # a healthy call first
    if rank == world - 1:
        dist.all_reduce(t, async_op=True)
        os._exit(1)
    start = time.monotonic()
    try:
        for _ in range(2):
            dist.all_reduce(t)
        return "no error"
    except (cgx.PeerError, cgx.CollectiveTimeoutError) as e:
        first, elapsed = e, time.monotonic() - start
    try:  # the group is unusable now, with the first failure's type and words
        dist.all_reduce(t)
        later = "no error"
    except cgx.PeerError as e2:
        later = str(e2)
    return type(first).__name__, isinstance(first, dist.DistNetworkError), elapsed, str(first), later


def test_a_peer_lost_across_hosts_raises_peer_error_before_the_timeout():
    results = run_ranks(_dies_across_hosts, 2, expect_exit={1}, timeout_s=120)
    kind, network_error, elapsed, message, later = values(results[:1])[0]
    assert (kind, network_error) == ("PeerError", True)
    assert elapsed < 20, elapsed  # the closed connection, not the group's timeout
    assert "unusable after an earlier failure" in later and message.split(": ")[-1] in later, (message, later)
