"""cgx.DiLoCo with sparse outer gradients (top_k=): each sync's average is what the
replicas sent, decoded alike everywhere; what a replica did not send stays in its
residual, exactly; bit-identical global weights; checkpoint and resume; bad settings.
Real processes."""

from __future__ import annotations

import warnings

import pytest
import torch

from harness import init_cgx, run_ranks, values
from test_diloco import _checkpoint_resume, _model, _train_step

_TOP_K = dict(k=4, chunk=64)


def _sparse_syncs(rank, world, overlap, decay):
    """Trains 12 steps (sync_every 4, 2 fragments, 2 bits); records, for every sync, its
    outer gradient and the residual before it, what this rank sent (as decoded), the
    residual after it, and the average."""
    import cgx
    from cgx.diloco import sparse, syncs

    init_cgx(rank, world)
    start, encode, complete = syncs.OwnPlacesSync.start, sparse.SparsePlan.encode, syncs.Sync.complete
    apply = syncs.Sync.apply
    sent = []

    def recording_start(cls, fragment, replicas, step, due, trained, rows, delta, *args):
        sent.append({"delta": delta.clone(), "before": replicas.residuals.gather(fragment.numel, fragment.compressed,
                                                                                 delta.device), "fragment": fragment.index})
        return start(fragment, replicas, step, due, trained, rows, delta, *args)

    def recording_encode(self, values_, residual=None):
        payload = encode(self, values_, residual)
        carried = torch.zeros_like(values_)  # what the others decode of it
        self.add(payload, carried)
        sent[-1].update({"values": values_.clone(), "carried": carried, "layout": self.layout,
                         "nbytes": self.nbytes})
        return payload

    def recording_complete(sync, replicas):
        decoding = getattr(sync, "payloads", None) is not None
        complete(sync, replicas)
        if decoding:
            sent[-1]["average"] = sync.outer_gradient.clone()
            sent[-1]["residual"] = None if sync.residual is None else sync.residual.clone()

    def recording_apply(sync, replicas, overlap, mix):
        fragment = sync.fragment
        record = next(r for r in reversed(sent) if r.get("fragment") == fragment.index and "kept" not in r)
        record["global_before"] = torch.cat([m.global_weight.reshape(-1) for m in fragment.members])
        apply(sync, replicas, overlap, mix)
        record["global_after"] = torch.cat([m.global_weight.reshape(-1) for m in fragment.members])
        record["kept"] = replicas.residuals.gather(fragment.numel, fragment.compressed, record["delta"].device)
    sparse.SparsePlan.encode, syncs.Sync.complete = recording_encode, recording_complete
    syncs.OwnPlacesSync.start, syncs.Sync.apply = classmethod(recording_start), recording_apply
    return sent, *_train_12_steps(rank, overlap, cgx.diloco.TopK(**_TOP_K, decay=decay))


@pytest.mark.parametrize("overlap,decay", [(0, 1.0), (1, 1.0), (0, 0.5)])
def test_a_sparse_sync_averages_what_each_replica_sent_and_keeps_the_rest_exactly(overlap, decay):
    world = 3
    results = values(run_ranks(_sparse_syncs, world, args=(overlap, decay), timeout_s=120))
    syncs = [r[0] for r in results]
    assert len(syncs[0]) == 6 and all(len(s) == 6 for s in syncs)
    for i in range(6):
        # The average: every rank's payload decoded and summed in rank order, over the ranks.
        expected = torch.zeros_like(syncs[0][i]["carried"])
        for rank in range(world):
            expected += syncs[rank][i]["carried"]
        expected /= world
        for rank in range(world):
            record = syncs[rank][i]
            assert torch.equal(record["average"], expected), (i, rank)
            # What it chose from: its outer gradient plus its residual, decayed.
            assert torch.equal(record["values"], record["delta"] + record["before"] if decay == 1
                               else record["delta"] + decay * record["before"]), (i, rank)
            assert record["before"].abs().sum() > 0 or i < 2  # (from each fragment's second sync on)
            # What it did not send is kept, exactly: residual = values - sent, on the compressed layers.
            compressed = [(o, n) for o, n, bits, *_ in record["layout"] if bits != 32]
            # With overlap, the local weights keep mix (0.5) of their drift from the new global
            # weights, which the next outer gradient measures again: that part leaves the residual.
            retained = torch.zeros_like(record["delta"]) if overlap == 0 else (
                record["delta"] - (record["global_before"] - record["global_after"])) * 0.5
            for offset, numel in compressed:
                kept = record["residual"].narrow(0, offset, numel)
                assert torch.equal(kept, record["values"].narrow(0, offset, numel)
                                   - record["carried"].narrow(0, offset, numel)), (i, rank, offset)
                assert torch.equal(record["kept"].narrow(0, offset, numel),
                                   kept - retained.narrow(0, offset, numel)), (i, rank, offset)
                # At most k values of each chunk sent; the raw layers whole.
                carried = record["carried"].narrow(0, offset, numel)
                for start in range(0, numel, _TOP_K["chunk"]):
                    assert (carried[start:start + _TOP_K["chunk"]] != 0).sum() <= _TOP_K["k"]
            raw = [(o, n) for o, n, bits, *_ in record["layout"] if bits == 32]
            for offset, numel in raw:
                assert torch.equal(record["carried"].narrow(0, offset, numel), record["values"].narrow(0, offset, numel))
    # Bit-identical global weights on every rank after every step.
    for step, weights in enumerate(results[0][1]):
        for rank in range(1, world):
            assert all(torch.equal(weights[n], results[rank][1][step][n]) for n in weights), (step, rank)
    # The payload counted is what each rank sent: its plan's bytes, a sync each.
    for sent, _, stats in results:
        assert stats["payload_bytes"] == sum(s["nbytes"] for s in sent)
        assert stats["payload_bytes"] * 8 < stats["uncompressed_payload_bytes"]


def test_a_sparse_run_resumes_from_a_checkpoint_bit_identically():
    for in_flight, residuals, differing in values(run_ranks(_checkpoint_resume, 2, args=(_TOP_K,), timeout_s=120)):
        assert in_flight == 1 and residuals > 0  # a sync in flight and residuals, saved and resumed
        assert differing == []


def _bad_sparse_settings(rank, world):
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for build in (lambda: cgx.diloco.TopK(k=0, chunk=64), lambda: cgx.diloco.TopK(k=65, chunk=64),
                  lambda: cgx.diloco.TopK(k=4, chunk=64, decay=0),
                  lambda: cgx.DiLoCo(model, inner, sync_every=4, bits=32, top_k=cgx.diloco.TopK(k=4, chunk=64)),
                  lambda: cgx.DiLoCo(model, inner, sync_every=4, top_k=cgx.diloco.TopK(k=8, chunk=1 << 20)),
                  lambda: cgx.DiLoCo(model, inner, sync_every=4, top_k=0.01),
                  lambda: cgx.DiLoCo(model, inner, sync_every=4, top_k=cgx.diloco.TopK(k=4, chunk=64),
                                     policy=cgx.CompressionPolicy(bits=2, minimal_size=1 << 20)),
                  # A layer a fragment each (each at offset 0 of its fragment): chunks fit.
                  lambda: cgx.DiLoCo(model, inner, sync_every=5, fragments=5, top_k=cgx.diloco.TopK(k=4, chunk=64))):
        try:
            built = build()
            if isinstance(built, cgx.DiLoCo):
                built.close()
            messages.append(None)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    warned = []
    for momentum in (0.9, 0.0):  # DiLoCo's default, and what sparse syncs were measured with
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cgx.DiLoCo(model, inner, sync_every=4, outer_momentum=momentum, nesterov=momentum > 0,
                       top_k=cgx.diloco.TopK(k=4, chunk=64)).close()
        warned.append([str(w.message) for w in caught if "outer momentum" in str(w.message)])
    return messages, warned


def test_bad_sparse_settings_raise_naming_the_setting():
    expected = ["k must be an integer >= 1", "k=65 is more than chunk=64", "decay must be in (0, 1]",
                "top_k with bits=32",
                "top_k's chunk=1048576 is larger than every compressed layer",
                "top_k must be a cgx.diloco.TopK", "top_k with no compressed layer", None]
    for messages, (with_momentum, without) in values(run_ranks(_bad_sparse_settings, 2, timeout_s=60)):
        assert len(with_momentum) == 1 and "give outer_lr=1.5, outer_momentum=0, nesterov=False" in with_momentum[0]
        assert without == []
        assert len(messages) == len(expected)
        for want, got in zip(expected, messages):
            assert got == want if want is None else got is not None and want in got, (want, got)


def _top_k_differing(rank, world):
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for top_k in (cgx.diloco.TopK(k=4 + rank, chunk=64), cgx.diloco.TopK(k=4, chunk=64, decay=0.5 + 0.25 * rank),
                  cgx.diloco.TopK(k=4, chunk=64) if rank else None):
        try:
            cgx.DiLoCo(model, inner, sync_every=4, top_k=top_k).close()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_top_k_differing_between_ranks_is_refused_naming_the_field_and_both_values():
    rank_0, rank_1 = values(run_ranks(_top_k_differing, 2, timeout_s=60))
    assert ["top_k.k 4 here, 5 on group rank 1" in m for m in rank_0[:1]] == [True]
    assert ["top_k.k 5 here, 4 on group rank 0" in m for m in rank_1[:1]] == [True]
    assert "top_k.decay 0.5 here, 0.75 on group rank 1" in rank_0[1]
    assert "top_k False here, True on group rank 1" in rank_0[2]
    assert "top_k True here, False on group rank 0" in rank_1[2]


@pytest.mark.parametrize("numel,k,chunk", [(5000, 32, 1024), (3000, 7, 7), (1000, 1, 7), (999, 3, 1000)])
def test_a_payload_carries_each_chunks_top_k_places_in_elias_fanos_bits(numel, k, chunk):
    """One process: the places decode as the top-k of each chunk; a place costs the
    low bits plus the chunk's unary bitmap (7 bits at 32 of 1,024, not 10); a payload
    with a place too many or too few is refused, not misread."""
    from cgx.diloco.sparse import SparsePlan, TopK

    plan = SparsePlan([(0, numel, 2, 512, "maxmin"), (numel, 10, 32, 512, "maxmin")], TopK(k, chunk))
    values = torch.randn(numel + 10, generator=torch.Generator().manual_seed(numel))
    residual = torch.full_like(values, float("nan"))
    payload = plan.encode(values, residual)
    assert payload.numel() == plan.nbytes
    sent = torch.zeros_like(values)
    plan.add(payload, sent)
    assert torch.equal(residual[:numel], values[:numel] - sent[:numel])  # kept: what was not sent
    assert torch.equal(sent[numel:], values[numel:]) and torch.equal(residual[numel:], torch.zeros(10))  # raw: whole
    assert torch.equal(plan.encode(values), payload)  # the same without a residual
    piece = plan.pieces[0]
    width = min(chunk, numel)
    padded = torch.cat([values[:numel], values.new_zeros(-numel % width)]).view(-1, width)
    chosen = padded.abs().topk(min(k, width), dim=1).indices.sort(dim=1).values
    expected = torch.zeros(padded.shape, dtype=torch.bool).scatter_(1, chosen, True).view(-1)[:numel]
    assert torch.equal(sent[:numel] != 0, expected)
    low_bits = (width // piece.kept).bit_length() - 1
    per_chunk = piece.kept * low_bits + piece.kept + ((width - 1) >> low_bits) + 1
    low_bytes = -(-piece.rows * piece.kept * low_bits // 8)
    assert piece.code_bytes == low_bytes + -(-piece.rows * (per_chunk - piece.kept * low_bits) // 8)
    if (numel, k, chunk) == (5000, 32, 1024):
        assert per_chunk == 7 * 32
    broken = payload.clone()
    broken[low_bytes] ^= 0x02  # one bit of the first chunk's bitmap flipped
    with pytest.raises(ValueError, match="sparse payload holds"):
        plan.add(broken, torch.zeros_like(values))


def _shared_syncs(rank, world):
    """Trains 12 steps with shared places (sync_every 4, 2 fragments, 2 bits, compressed
    whatever the size); records, for every sync, the values it chose from, its places,
    what it selected, its residual after and the average."""
    import os

    os.environ["CGX_COMPRESSION_AUTO"] = "0"  # the compressed path, which keeps residuals
    import cgx
    from cgx.diloco import sparse, syncs
    from cgx.layers import layout_bytes

    init_cgx(rank, world)
    places_of, complete = sparse.SparsePlan.shared_places, syncs.Sync.complete
    sent = []

    def recording_places(self, seed, device):
        places = places_of(self, seed, device)
        sent.append({"places": places, "layout": self.selected_layout(), "pieces": self.pieces})
        return places

    def recording_complete(sync, replicas):
        shared = isinstance(sync, syncs.SharedPlacesSync) and sync.work is not None
        if shared:
            sent[-1]["values"] = sync.residual.clone()  # (the values until the allreduce completed)
            sent[-1]["bytes"] = layout_bytes(sent[-1]["layout"], replicas.skip_incomplete)
        complete(sync, replicas)
        if shared:
            sent[-1]["average"] = sync.outer_gradient.clone()
            sent[-1]["residual"] = sync.residual.clone()
    sparse.SparsePlan.shared_places, syncs.Sync.complete = recording_places, recording_complete
    return sent, *_train_12_steps(rank, 0, cgx.diloco.TopK(**_TOP_K, shared=True))


def _train_12_steps(rank, overlap, top_k):
    """12 steps, sync_every 4, 2 fragments, 2 bits: the global weights after each, the stats."""
    import cgx

    model = _model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=4, fragments=2, bits=2, overlap=overlap, top_k=top_k)
    global_weights = []
    for step in range(12):
        _train_step(model, inner, rank, step)
        global_weights.append(diloco.state_dict()["global_weights"])
    diloco.close()
    return global_weights, diloco.stats()


def test_shared_places_are_the_same_on_every_replica_and_what_is_not_sent_is_kept():
    world = 3
    results = values(run_ranks(_shared_syncs, world, timeout_s=120))
    syncs = [r[0] for r in results]
    assert len(syncs[0]) == 6 and all(len(s) == 6 for s in syncs)
    for i in range(6):
        first = syncs[0][i]
        for rank in range(world):
            assert all(a is None and b is None or torch.equal(a, b)
                       for a, b in zip(first["places"], syncs[rank][i]["places"])), (i, rank)
        assert any(p is not None for p in first["places"])
        # Syncs draw other places.
        assert i < 2 or not torch.equal(next(p for p in first["places"] if p is not None),
                                        next(p for p in syncs[0][i - 2]["places"] if p is not None))
        in_places = torch.zeros_like(first["average"], dtype=torch.bool)
        for piece, places in zip(first["pieces"], first["places"]):
            target = in_places.narrow(0, piece.offset, piece.numel)
            if places is None:
                target.fill_(True)
            else:
                rows = torch.zeros(piece.rows * piece.width, dtype=torch.bool)
                rows.view(piece.rows, piece.width).scatter_(1, places, True)
                target.copy_(rows[:piece.numel])
        compressed = torch.zeros_like(in_places)
        for piece in first["pieces"]:
            compressed.narrow(0, piece.offset, piece.numel).fill_(piece.bits != 32)
        for rank in range(world):
            record = syncs[rank][i]
            assert torch.equal(record["average"], first["average"]), (i, rank)  # bit-identical
            assert torch.all(record["average"][~in_places] == 0)
            # Not sent: kept exactly; sent: what the allreduce dropped of it.
            unsent = ~in_places & compressed
            assert torch.equal(record["residual"][unsent], record["values"][unsent])
            assert record["residual"][in_places & compressed].abs().sum() > 0
        # The residuals add up to what the average lacked: sum(values - residual) = world * average.
        sent_sum = sum(torch.where(compressed, s[i]["values"] - s[i]["residual"], s[i]["values"])
                       for s in syncs)
        torch.testing.assert_close(sent_sum, world * first["average"], rtol=1e-5, atol=1e-6)
    for step, weights in enumerate(results[0][1]):
        for rank in range(1, world):
            assert all(torch.equal(weights[n], results[rank][1][step][n]) for n in weights), (step, rank)
    # The payload counted: the places' values in their compressed size (no places), a sync each.
    for sent, _, stats in results:
        assert stats["payload_bytes"] == sum(s["bytes"] for s in sent)
        assert all(s["bytes"] < sum(p.nbytes for p in s["pieces"]) for s in sent)  # less than with own places


def _compressed_layers_frozen_at_first(rank, world):
    """Fine-tuning's schedule: every compressed layer (the weights) frozen when DiLoCo is
    built, trained from step 4 on; 12 steps of sync_every 4, 2 fragments, 2 bits."""
    import cgx

    init_cgx(rank, world)
    model = _model(0)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    for p in weights:
        p.requires_grad_(False)
    start = [p.detach().clone() for p in weights]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=4, fragments=2, bits=2, top_k=cgx.diloco.TopK(k=4, chunk=64))
    global_weights = []
    for step in range(12):
        if step == 4:
            for p in weights:
                p.requires_grad_(True)
        _train_step(model, inner, rank, step)
        global_weights.append(diloco.state_dict()["global_weights"])
    diloco.close()
    moved = [not torch.equal(p, s) for p, s in zip(weights, start)]
    return global_weights, moved, diloco.stats()


def test_a_sparse_run_starts_with_its_compressed_layers_frozen_and_syncs_them_once_trained():
    """(A top_k check once looked only at the layers trained at construction: it refused.)"""
    results = values(run_ranks(_compressed_layers_frozen_at_first, 2, timeout_s=120))
    (weights0, moved, stats), (weights1, _, _) = results
    assert all(moved)
    for step in range(12):
        assert weights0[step].keys() == weights1[step].keys()
        assert all(torch.equal(weights0[step][n], weights1[step][n]) for n in weights0[step]), step
    assert set(weights0[-1]) == {n for n, _ in _model(0).named_parameters()}  # the weights joined
    assert stats["payload_bytes"] * 4 < stats["uncompressed_payload_bytes"]  # sent sparse
