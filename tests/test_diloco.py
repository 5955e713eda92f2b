"""cgx.DiLoCo: exact against a hand-written DiLoCo, compressed within the quantizer's
bound, the fragment schedule and the overlap's merge, the per-host and FSDP2 forms,
parameters joining and leaving the synced set, replicas out of step, checkpoint and
resume, a peer dying mid-sync, and bad input. Real processes."""

from __future__ import annotations

import io
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from bounds import allreduce_error_bound
from harness import init_cgx, run_ranks, values


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 32)]
    for _ in range(3):
        layers += [torch.nn.ReLU(), torch.nn.Linear(32, 32)]
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train_step(model, inner, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    inner.zero_grad()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _resume(saved: io.BytesIO, model, inner, diloco) -> dict:
    """Loads a checkpoint of {"model", "inner", "diloco"} states into the three; returns it."""
    saved.seek(0)
    checkpoint = torch.load(saved)
    model.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["inner"])
    diloco.load_state_dict(checkpoint["diloco"])
    return checkpoint


# ---- exact DiLoCo equals a hand-written one


def _exact_against_reference(rank, world):
    import cgx

    init_cgx(rank, world)
    steps, every = 7, 3
    model = _model(rank)  # replicas start apart: DiLoCo starts them from rank 0's weights
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=every, bits=32)
    for step in range(steps):
        _train_step(model, inner, rank, step)
    diloco.close()

    reference = _model(0)
    ref_inner = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    global_weights = [p.detach().clone() for p in reference.parameters()]
    outer = torch.optim.SGD(global_weights, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(steps):
        _train_step(reference, ref_inner, rank, step)
        if (step + 1) % every == 0:
            with torch.no_grad():
                outer_gradient = torch.cat([(g - p).reshape(-1) for g, p in zip(global_weights, reference.parameters())])
                dist.all_reduce(outer_gradient)
                outer_gradient.div_(world)
                offset = 0
                for g in global_weights:
                    g.grad = outer_gradient[offset:offset + g.numel()].view_as(g)
                    offset += g.numel()
                outer.step()
                for g, p in zip(global_weights, reference.parameters()):
                    p.copy_(g)
    mismatched = [n for (n, a), b in zip(model.named_parameters(), reference.parameters()) if not torch.equal(a, b)]
    stats = diloco.stats()
    with pytest.warns(DeprecationWarning, match="peak_payload_bytes"):
        old_names = (stats["peak_bytes"] == stats["peak_payload_bytes"] > 0, "peak_bytes" in stats)
    with pytest.warns(DeprecationWarning, match="uncompressed_payload_bytes"):
        old_names += (stats.get("bytes_uncompressed") == stats["uncompressed_payload_bytes"],)
    # The hyper-parameters stay attributes that can be set, checked as the constructor checks them.
    diloco.mix, diloco.residuals = 0.25, {}
    with pytest.raises(ValueError, match="mix must be in"):
        diloco.mix = 2.0
    settable = (diloco.mix == 0.25, diloco.residuals == {})
    return mismatched, stats, old_names, settable


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exact_diloco_equals_a_hand_written_reference(world):
    for mismatched, stats, old_names, settable in values(run_ranks(_exact_against_reference, world, timeout_s=120)):
        assert mismatched == []
        assert stats["outer_syncs"] == 2
        assert stats["payload_bytes"] == stats["uncompressed_payload_bytes"]
        # bits=32: every layer exact by the policy, said so.
        assert stats["exact_why"] == {"policy": {"calls": 2, "bytes": stats["payload_bytes"]}}
        assert (stats["exact_calls"], stats["exact_bytes"]) == (2, stats["payload_bytes"])
        assert old_names == (True, True, True)  # the names from before docs/stats.md still read, warning
        assert settable == (True, True)


# ---- compressed syncs: the quantizer's bound, bit-identical global weights


def _compressed_syncs(rank, world, error_feedback):
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    captured = {}
    # Registered first, so it sees the local weights after the inner step, before the sync.
    inner.register_step_post_hook(lambda *_: captured.update(_weights(model)))
    # Plain outer SGD (lr 1, no momentum): what a sync applies is global_before - global_after.
    diloco = cgx.DiLoCo(model, inner, sync_every=2, bits=4, bucket_size=64, outer_lr=1.0, outer_momentum=0.0,
                        nesterov=False, error_feedback=error_feedback)
    applied_sum, exact_sum, excess, last_inputs = {}, {}, [], {}
    for step in range(8):
        before = diloco.state_dict()
        _train_step(model, inner, rank, step)
        after = diloco.state_dict()
        if after["stats"]["outer_syncs"] == before["stats"]["outer_syncs"]:
            continue
        for name, g_before in before["global_weights"].items():
            delta = g_before - captured[name]
            inputs = [torch.empty_like(delta) for _ in range(world)]
            # What each rank put in: its outer gradient (plus its residual, with feedback).
            fed = delta + before["residuals"].get(name, torch.zeros_like(delta)).view_as(delta)
            dist.all_gather(inputs, fed)
            exact = torch.stack([i.double() for i in inputs]).mean(0)
            applied = (g_before - after["global_weights"][name]).double()
            # The subtraction global - average rounds to float32 once more.
            rounding = 4 * 2.0**-24 * float(g_before.abs().max() + exact.abs().max())
            bound = rounding + (allreduce_error_bound(inputs, 4, average=True) if name.endswith("weight") else 0.0)
            excess.append(float((applied - exact).abs().max()) - bound)
            deltas = [torch.empty_like(delta) for _ in range(world)]
            dist.all_gather(deltas, delta)
            exact_sum[name] = exact_sum.get(name, 0) + torch.stack([d.double() for d in deltas]).mean(0)
            applied_sum[name] = applied_sum.get(name, 0) + applied
            last_inputs[name] = inputs
    drift = {n: float((applied_sum[n] - exact_sum[n]).abs().max()) - rounding * 8
             - allreduce_error_bound(last_inputs[n], 4, average=True) for n in applied_sum if n.endswith("weight")}
    return max(excess), drift, diloco.state_dict()["global_weights"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_compressed_syncs_stay_in_the_bound_and_replicas_agree(world, error_feedback):
    # The bound is the maxmin scheme's (tests/bounds.py); DiLoCo takes the group's scheme.
    results = values(run_ranks(_compressed_syncs, world, args=(error_feedback,), timeout_s=120,
                               env={"CGX_COMPRESSION_SCHEME": "maxmin"}))
    for excess, drift, global_weights in results:
        assert excess <= 0, excess  # every sync: within one allreduce's bound of the exact average
        if error_feedback:  # the running sum of applied updates lags the exact sum by one sync's error at most
            assert all(d <= 0 for d in drift.values()), drift
        for name, tensor in global_weights.items():
            assert torch.equal(tensor, results[0][2][name]), name


# ---- the schedule: fragments at their offsets, the merge k steps later


def _schedule(rank, world, overlap, pattern):
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    captured = {}
    inner.register_step_post_hook(lambda *_: captured.update(_weights(model)))
    diloco = cgx.DiLoCo(model, inner, sync_every=8, fragments=4, bits=4, overlap=overlap, mix=0.25,
                        fragment_pattern=pattern)
    fragments = diloco.state_dict()["fragments"]
    changed, merges_exact = {}, True
    for step in range(1, 25):
        before = diloco.state_dict()["global_weights"]
        _train_step(model, inner, rank, step)
        after = diloco.state_dict()["global_weights"]
        changed[step] = sorted(n for n in after if not torch.equal(before[n], after[n]))
        for name in changed[step]:  # the merge, bit for bit
            local = dict(model.named_parameters())[name].detach()
            expected = after[name] if overlap == 0 else torch.lerp(after[name], captured[name], 0.25)
            merges_exact &= torch.equal(local, expected)
        with cgx.exact():  # lockstep ranks, as a training loop's loss averaging makes them
            dist.all_reduce(torch.zeros(1))
    # The largest layer as a sync sends it: a 4-bit weight in the group's buckets, a raw bias.
    from cgx.layers import layout_bytes

    settings = cgx.get_backend().settings
    layer_bytes = max(layout_bytes([(0, m.weight.numel(), 4, settings.bucket_size), (0, m.bias.numel(), 32, 1)],
                                   settings.skip_incomplete_buckets) for m in model if isinstance(m, torch.nn.Linear))
    # Offsets stay the construction's (0, 2, 4, 6): a sync_every at or below one would
    # leave that fragment without a step to sync at.
    try:
        diloco.sync_every = 6
        stranded = None
    except ValueError as e:
        stranded = str(e)
    diloco.sync_every = 7 + overlap
    return fragments, changed, merges_exact, diloco.stats(), layer_bytes, (stranded, diloco.sync_every)


@pytest.mark.parametrize("overlap,pattern", [(0, "strided"), (2, "strided"), (1, "sequential")])
def test_each_fragment_syncs_once_per_interval_at_its_offset(overlap, pattern):
    results = values(run_ranks(_schedule, 2, args=(overlap, pattern), timeout_s=120))
    fragments, changed, merges_exact, stats, layer_bytes, (stranded, sync_every) = results[0]
    assert "sync_every=6 leaves fragment(s) [3] (offsets [6]" in stranded, stranded
    assert sync_every == 7 + overlap
    assert len(fragments) == 4 and all(fragments)
    for p, names in enumerate(fragments):
        starts = [t for t in range(1, 25) if t % 8 == p * 8 // 4]
        applied = [t + overlap for t in starts if t + overlap <= 24]
        for name in names:
            assert [t for t, c in changed.items() if name in c] == applied, (name, p)
    assert merges_exact
    assert stats["outer_syncs"] == sum(len([t for t in range(1, 25) if t % 8 == p * 2 and t + overlap <= 24])
                                       for p in range(4))
    # Peak bytes of one sync: at most 1/P of a whole-model sync plus one layer, in the bytes
    # that travel (every fragment started 3 times in 24 steps: 3 whole-model syncs' worth).
    whole = stats["payload_bytes"] / 3
    assert whole / 4 < stats["peak_payload_bytes"] <= whole / 4 + layer_bytes, (stats, layer_bytes)


def _waits(rank, world, overlap):
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = cgx.DiLoCo(model, inner, sync_every=4, fragments=2, bits=4, overlap=overlap)
    for step in range(16):
        _train_step(model, inner, rank, step)
        # Compute slower than the link: the next step begins once the syncs in flight
        # have arrived (the event a fast link gives, not a time that a loaded machine stretches).
        while not all(sync.work is None or sync.work.is_completed() for sync in diloco._in_flight):
            time.sleep(0.001)
        with cgx.exact():
            dist.all_reduce(torch.zeros(1))
    diloco.close()
    return diloco.stats()


@pytest.mark.parametrize("overlap", [0, 1])
def test_the_inner_loop_waits_on_a_fast_link_only_without_overlap(overlap):
    for stats in values(run_ranks(_waits, 2, args=(overlap,), timeout_s=120)):
        assert stats["outer_syncs"] == 8
        assert stats["waits"] == (8 if overlap == 0 else 0), stats


def test_fragment_split_keeps_each_fragment_within_its_share_plus_one_layer():
    from cgx.diloco.fragments import split_layers as _split

    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.choice([0, 1, 7, 100, 5000]) for _ in range(rng.randint(1, 30))]
        fragments = rng.randint(1, len(sizes))
        for pattern in ("strided", "sequential"):
            choice = _split(sizes, fragments, pattern)
            loads = [sum(s for s, q in zip(sizes, choice) if q == p) for p in range(fragments)]
            assert sorted(set(choice)) == list(range(fragments)), (sizes, pattern)
            assert max(loads) * fragments <= sum(sizes) + fragments * max(sizes), (sizes, pattern, loads)
            if pattern == "sequential":
                assert choice == sorted(choice)
    assert _split([10] * 8, 4, "strided") == [0, 1, 2, 3, 0, 1, 2, 3]  # alike layers: i mod P


# ---- deployments: DDP inside a host, FSDP2 inside a replica


def _counts_what_auto_sent(rank, world):
    """With CGX_COMPRESSION_AUTO on, a class's first three calls are compressed and its
    fourth goes the exact way whatever the timings: the fourth sync counts as float32."""
    import cgx
    from cgx.layers import layout_bytes

    init_cgx(rank, world, pg_options=cgx.Config(minimal_size=0))  # auto is on by default
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=2, bits=4)
    sent = []
    for step in range(8):
        _train_step(model, inner, rank, step)
        if step % 2 == 1:
            sent.append(diloco.stats()["payload_bytes"])
    (fragment,) = diloco._fragments
    (entry,) = cgx.stats()["auto"]
    return sent, layout_bytes(fragment.layout, False), fragment.numel, entry["exact_calls"], diloco.stats()


def test_a_sync_auto_sent_exactly_counts_as_float32_and_says_why():
    for sent, compressed, numel, exact_calls, stats in values(run_ranks(_counts_what_auto_sent, 2)):
        assert exact_calls == 1 and compressed < numel
        assert sent == [compressed * (sync + 1) for sync in range(3)] + [3 * compressed + 4 * numel]
        assert stats["exact_why"] == {"auto": {"calls": 1, "bytes": 4 * numel}}
        assert (stats["exact_calls"], stats["exact_bytes"]) == (1, 4 * numel)


def _sparse(kind):
    """DiLoCo's top_k for a test's `kind`: None (dense), "own" or "shared" places."""
    import cgx

    return None if kind is None else cgx.diloco.TopK(k=4, chunk=64, shared=kind == "shared")


def _per_host(rank, world, sparse):
    import cgx

    os.environ["CGX_HOSTNAME"] = f"host{rank // 2}"
    init_cgx(rank, world)
    host, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    across, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    model = torch.nn.parallel.DistributedDataParallel(_model(rank // 2), process_group=host)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with cgx.DiLoCo(model, inner, sync_every=3, fragments=1, bits=4, group=across, top_k=_sparse(sparse)) as diloco:
        for step in range(6):
            _train_step(model, inner, rank, step)
            if step == 3:
                mid = _weights(model)  # between syncs: the hosts' replicas apart
    return mid, _weights(model), diloco.stats()


@pytest.mark.parametrize("sparse", [None, "own", "shared"])
def test_per_host_form_ddp_inside_hosts_diloco_across(sparse):
    results = values(run_ranks(_per_host, 4, args=(sparse,), timeout_s=180))
    for name, tensor in results[0][1].items():
        for rank in range(4):  # after the last sync every rank holds the same weights
            assert torch.equal(results[rank][1][name], tensor), (rank, name)
    for name in results[0][0]:
        assert torch.equal(results[0][0][name], results[1][0][name])  # one host, one replica
        assert torch.equal(results[2][0][name], results[3][0][name])
    assert any(not torch.equal(results[0][0][n], results[2][0][n]) for n in results[0][0])
    assert results[0][2]["outer_syncs"] == 2 and results[0][2]["payload_bytes"] < results[0][2]["uncompressed_payload_bytes"]


def _fsdp_inner(rank, world, sparse):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import cgx

    init_cgx(rank, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    model = _model(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=2, fragments=2, bits=4, group=mesh["replica"].get_group(),
                        top_k=_sparse(sparse))
    shards = {n: p.to_local().numel() for n, p in model.named_parameters()}
    replica = mesh.get_coordinate()[0]
    fragments = diloco.state_dict()["fragments"]
    full = {}
    for step in range(4):
        _train_step(model, inner, replica, step)  # the ranks of a replica see one batch
        synced = fragments[(step + 1) % 2]  # fragment 1 syncs after steps 1 and 3, fragment 0 after 2 and 4
        full.update({n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if n in synced})
    diloco.close()
    return shards, full, diloco.stats()


@pytest.mark.parametrize("sparse", [None, "own"])
def test_fsdp2_inner_outer_step_on_local_shards(sparse):
    results = values(run_ranks(_fsdp_inner, 4, args=(sparse,), timeout_s=180))
    model = _model(0)
    shards, full, stats = results[0]
    assert sum(shards.values()) < sum(p.numel() for p in model.parameters())  # shards, not whole weights
    assert stats["uncompressed_payload_bytes"] == 4 * sum(shards.values()) * 2  # each shard synced twice
    for rank in range(4):
        assert results[rank][1].keys() == set(shards)
        for name, tensor in full.items():  # each fragment right after its sync: equal on every rank
            assert torch.equal(results[rank][1][name], tensor), (rank, name)


# ---- what is synced follows what the optimizer trains; replicas agree on it and on the step


def _head_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # replicas start apart: DiLoCo starts every parameter from rank 0's
    body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    model = torch.nn.Sequential(body, torch.nn.ReLU(), torch.nn.Linear(16, 4))
    body[2].weight.requires_grad_(False)  # unfrozen later, as fine-tuning schedules do
    return model


def _follows_the_optimizer(rank, world):
    import cgx

    init_cgx(rank, world)
    options = dict(sync_every=4, fragments=2, bits=4)  # fragment 1 syncs at steps 2, 6, ...; fragment 0 at 4, 8, ...

    def build(head_trained):
        model = _head_model(rank)
        inner = torch.optim.SGD(model[0].parameters(), lr=0.05)  # the head's group joins later
        if head_trained is not None:  # resuming: the optimizer and model as when the state was saved
            model[0][2].weight.requires_grad_(True)
            inner.add_param_group({"params": model[2].parameters()})
            model[2].requires_grad_(head_trained)
        return model, inner, cgx.DiLoCo(model, inner, **options)

    model, inner, diloco = build(None)
    frozen = model[0][2].weight
    start = frozen.detach().clone()  # equal on every rank already
    inner.add_param_group({"params": model[2].parameters()})
    seen, saved = {}, io.BytesIO()
    for step in range(16):
        if step == 6:
            frozen.requires_grad_(True)
        if step == 10:
            model[2].requires_grad_(False)  # frozen again: leaves the synced set
        if step == 12:
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()},
                       saved)
        _train_step(model, inner, rank, step)
        if step + 1 in (6, 10, 14, 16):
            seen[step + 1] = _weights(model), diloco.state_dict()["fragments"]
    diloco.close()

    resumed_model, resumed_inner, resumed = build(head_trained=False)
    checkpoint = _resume(saved, resumed_model, resumed_inner, resumed)
    for step in range(12, 16):
        _train_step(resumed_model, resumed_inner, rank, step)
    differing = [n for n, w in _weights(resumed_model).items() if not torch.equal(w, seen[16][0][n])]
    resumed.close()

    headless = _head_model(rank)
    headless[2] = torch.nn.Identity()
    try:
        cgx.DiLoCo(headless, torch.optim.SGD(headless.parameters(), lr=0.05), **options).load_state_dict(
            checkpoint["diloco"])
        refused = "loaded"
    except ValueError as e:
        refused = str(e)

    model = _head_model(rank)  # the replicas disagree: rank 0 adds the head's group, rank 1 does not
    inner = torch.optim.SGD(model[0].parameters(), lr=0.05)
    with cgx.DiLoCo(model, inner, sync_every=2, bits=4):
        if rank == 0:
            inner.add_param_group({"params": model[2].parameters()})
        try:
            for step in range(2):
                _train_step(model, inner, rank, step)
            disagreement = "no error"
        except ValueError as e:
            disagreement = str(e)
    return start, seen, differing, refused, disagreement


def test_synced_parameters_follow_the_optimizer_on_every_replica():
    results = values(run_ranks(_follows_the_optimizer, 2, timeout_s=120))
    for rank in range(2):
        start, seen, differing, refused, disagreement = results[rank]
        assert torch.equal(start, results[0][0])  # a frozen parameter starts from rank 0's too
        body, head, unfrozen = ["0.0.weight", "0.0.bias", "0.2.bias"], ["2.weight", "2.bias"], ["0.2.weight"]
        assert seen[6][1] == [body[:2], body[2:] + head]  # the head joined the least loaded fragment
        assert seen[10][1] == [body[:2], body[2:] + head + unfrozen]  # the unfrozen weight: its layer's
        assert seen[14][1] == seen[16][1] == [body[:2], body[2:] + unfrozen]  # the head left
        # Each right after the sync it first joined (or left) in: equal on every replica.
        for step, names in ((6, head), (10, unfrozen), (14, head), (16, head)):
            for name in names:
                assert torch.equal(seen[step][0][name], results[0][1][step][0][name]), (rank, step, name)
        assert torch.equal(seen[14][0]["2.weight"], seen[16][0]["2.weight"])  # frozen: stays put
        assert differing == []  # resumed from a state taken while the head was leaving: bit-identical
        assert "the state syncs '2.weight', a parameter this model does not have" in refused, refused
    assert "'2.weight' is trained here, not on group rank 1" in results[0][4], results[0][4]
    assert "'2.weight' is trained on group rank 0, not here" in results[1][4], results[1][4]
    assert "at the sync of inner step 2" in results[1][4]
    # Not trivially equal: between syncs the replicas train apart (fragment 1 last synced at step 14).
    assert not torch.equal(results[0][1][16][0]["0.2.bias"], results[1][1][16][0]["0.2.bias"])


def _skipped_step(rank, world, overlap, fragments, bits, steps):
    import cgx

    init_cgx(rank, world, timeout_s=20)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = cgx.DiLoCo(model, inner, sync_every=4, fragments=fragments, bits=bits, overlap=overlap)
    start = time.monotonic()
    try:
        for step in range(steps):
            if rank == 1 and step == 5:
                continue  # as GradScaler skips optimizer.step() where the gradients have Inf
            _train_step(model, inner, rank, step)
        diloco.close()
        return "no error", diloco.step
    except RuntimeError as e:
        return str(e), time.monotonic() - start


@pytest.mark.parametrize("overlap,fragments,bits,steps", [(0, 1, 4, 10), (1, 2, 4, 10), (1, 1, 32, 12)])
def test_a_replica_that_skipped_a_step_raises_on_every_rank_naming_the_steps(overlap, fragments, bits, steps):
    (ahead, ahead_s), (behind, behind_s) = values(run_ranks(_skipped_step, 2,
                                                            args=(overlap, fragments, bits, steps), timeout_s=60))
    if bits == 32:  # rank 0's exact sync of step 12 meets rank 1's close(): their rows name both
        assert "the sync of inner step 12 here, close() after inner step 11 on group rank 1" in ahead, ahead
        assert "close() after inner step 11 here, the sync of inner step 12 on group rank 0" in behind, behind
    elif fragments == 1:  # both sync at steps 4 and 8, then meet in close(): their rows name both steps
        assert "close() after inner step 10 here, close() after inner step 9 on group rank 1" in ahead, ahead
        assert "close() after inner step 9 here, close() after inner step 10 on group rank 0" in behind, behind
    else:  # rank 0's sync of step 10 (fragment 1) meets rank 1's close(): calls of other sizes
        assert "out of step at the sync of inner step 10 here" in ahead, ahead
        assert "out of step at close() after inner step 9 here" in behind, behind
    assert "GradScaler" in ahead and "GradScaler" in behind
    assert ahead_s < 20 and behind_s < 20  # at once, not at the group's timeout


# ---- checkpoint and resume, failure mid-sync


def _checkpoint_resume(rank, world, top_k=None):
    """12 steps uninterrupted against 6, a checkpoint (a sync in flight), a resume and 6
    more (`top_k`: a TopK's arguments, sparse outer gradients at 2 bits). Returns the syncs
    in flight and the residuals the checkpoint held, and the parameters that differ."""
    import cgx

    init_cgx(rank, world)
    options = dict(sync_every=4, fragments=2, bits=4, overlap=1)
    if top_k is not None:
        options.update(bits=2, top_k=cgx.diloco.TopK(**top_k))

    def build():
        model = _model(0)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, cgx.DiLoCo(model, inner, **options)

    model, inner, diloco = build()
    for step in range(12):
        _train_step(model, inner, rank, step)
    uninterrupted = _weights(model)
    diloco.close()

    model, inner, diloco = build()
    for step in range(6):
        _train_step(model, inner, rank, step)
    in_flight = diloco.stats()["in_flight"]
    saved, state = io.BytesIO(), diloco.state_dict()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": state}, saved)
    diloco.close()

    model, inner, diloco = build()  # as at the start, then the three states
    _resume(saved, model, inner, diloco)
    for step in range(6, 12):
        _train_step(model, inner, rank, step)
    resumed = _weights(model)
    return in_flight, len(state["residuals"]), [n for n in resumed if not torch.equal(resumed[n], uninterrupted[n])]


def test_checkpoint_with_a_sync_in_flight_resumes_bit_identically():
    for in_flight, residuals, differing in values(run_ranks(_checkpoint_resume, 2, timeout_s=120)):
        assert in_flight == 1 and residuals > 0
        assert differing == []


def _checkpoint_from_before_the_exact_counts(rank, world):
    """A state saved before DiLoCo counted the syncs sent exactly (no exact_* in its
    stats) loads: those counters start at none, the others go on."""
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=2, bits=32)
    for step in range(4):
        _train_step(model, inner, rank, step)
    state = diloco.state_dict()
    before = dict(state["stats"])
    for key in ("exact_calls", "exact_bytes", "exact_why"):
        del state["stats"][key]
    diloco.load_state_dict(state)
    _train_step(model, inner, rank, 4)
    _train_step(model, inner, rank, 5)
    return before, diloco.stats()


def test_a_checkpoint_from_before_the_exact_counts_loads():
    for before, after in values(run_ranks(_checkpoint_from_before_the_exact_counts, 2)):
        assert before["exact_calls"] == before["outer_syncs"] == 2  # bits=32: every sync exact, 'policy'
        assert after["outer_syncs"] == 3 and after["exact_calls"] == 1
        assert after["exact_why"] == {"policy": {"calls": 1, "bytes": after["exact_bytes"]}}
        assert after["payload_bytes"] == 3 * before["payload_bytes"] // 2


def _checkpoint_at_another_size(rank, world, saved_path):
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = cgx.DiLoCo(model, inner, sync_every=2, bits=4)
    if world == 2:
        for step in range(2):
            _train_step(model, inner, rank, step)
        if rank == 0:
            torch.save(diloco.state_dict(), saved_path)
        return "saved"
    state = torch.load(saved_path)
    try:
        diloco.load_state_dict(state)
        return "loaded"
    except ValueError as e:
        refused = str(e)
    diloco.load_state_dict({**state, "residuals": {}})  # the documented way to resume at another size
    return refused


def test_a_checkpoint_at_another_world_size_is_refused_unless_residuals_are_dropped(tmp_path):
    path = str(tmp_path / "diloco.pt")
    assert values(run_ranks(_checkpoint_at_another_size, 2, args=(path,))) == ["saved", "saved"]
    for message in values(run_ranks(_checkpoint_at_another_size, 3, args=(path,))):
        assert "saved in a group of 2 ranks, loaded in one of 3" in message, message


def _peer_dies_mid_sync(rank, world):
    import cgx

    init_cgx(rank, world, timeout_s=5)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = cgx.DiLoCo(model, inner, sync_every=2, bits=4, overlap=1)
    for step in range(3):
        _train_step(model, inner, rank, step)  # a first sync, applied at step 3
    before = diloco.state_dict()
    if rank == world - 1:
        os._exit(1)
    _train_step(model, inner, rank, 3)  # starts the second sync; the peer is gone
    start = time.monotonic()
    try:
        _train_step(model, inner, rank, 4)  # its result is due
        return "no error"
    except Exception as e:  # noqa: BLE001
        error, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - start
    after = diloco.state_dict()
    unchanged = all(
        before[key].keys() == after[key].keys() and all(torch.equal(before[key][n], after[key][n]) for n in before[key])
        for key in ("global_weights", "outer_momentum", "residuals"))
    return error, elapsed, unchanged, len(after["in_flight"])


def test_a_peer_dying_mid_sync_raises_on_the_others_and_changes_nothing():
    results = run_ranks(_peer_dies_mid_sync, 3, expect_exit={2}, timeout_s=120)
    assert results[2] is None
    for error, elapsed, unchanged, in_flight in values(results[:2]):
        assert error.startswith(("CollectiveTimeoutError:", "PeerError:")), error
        assert elapsed < 5 + 5, elapsed
        assert unchanged
        assert in_flight == 0


# ---- bad input


def _bad_input(rank, world):
    import cgx

    init_cgx(rank, world, timeout_s=20)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for kwargs in ({"sync_every": 0}, {"sync_every": 8, "fragments": 6}, {"sync_every": 2, "fragments": 3},
                   {"sync_every": 4, "overlap": 4}, {"sync_every": 4, "bits": 9}, {"sync_every": 4, "mix": 1.5},
                   {"sync_every": 4, "fragment_pattern": "random"}):
        try:
            cgx.DiLoCo(model, inner, **kwargs)
            messages.append(f"no error for {kwargs}")
        except ValueError as e:
            messages.append(str(e))
    foreign = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    try:
        cgx.DiLoCo(model, foreign, sync_every=4)
    except ValueError as e:
        messages.append(str(e))
    try:
        cgx.DiLoCo(model, inner, sync_every=4 if rank == 0 else 5)
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_bad_input_raises_value_error_naming_the_argument():
    expected = ["sync_every must be an integer >= 1", "fragments=6 is more than the model's 5 layers",
                "fragments=3 is more than sync_every=2", "overlap=4 must be less than sync_every=4",
                "bits must be in 1..8", "mix must be in [0, 1]", "fragment_pattern must be one of",
                "inner_optimizer updates 1 tensor(s) that are not parameters of the model"]
    results = values(run_ranks(_bad_input, 2, timeout_s=60))
    for rank, messages in enumerate(results):
        assert len(messages) == len(expected) + 1, messages
        for want, got in zip(expected, messages):
            assert want in got, (want, got)
        mine, theirs = (4, 5) if rank == 0 else (5, 4)
        assert f"sync_every {mine} here, {theirs} on group rank {1 - rank}" in messages[-1], messages[-1]


def test_bad_input_needs_a_cgx_group_and_an_initialized_one():
    import cgx

    model = _model(0)
    with pytest.raises(RuntimeError, match="init_process_group first"):
        cgx.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4)
