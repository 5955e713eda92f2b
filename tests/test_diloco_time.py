"""cgx.DiLoCo's time schedule (sync_every a datetime.timedelta), replicas of unequal
speed: every sync weighs each replica's outer gradient by the inner steps behind it (exact
DiLoCo against the weighed average written out), the global weights stay bit-identical
across replicas (dense, both sparse forms, overlap, a 10x slower replica, one stopped for
several intervals, an interval shorter than an inner step, one replica's interval changed
alone, one replica's clock jumping ahead), a layer unfrozen between the same two syncs on
every replica (and a clear error where not), a checkpoint with a sync in flight resumes,
replicas that end at different syncs raise on every rank, bad input, and the clock
itself. Real processes; the replicas' speeds differ by sleeps, and no test asserts on how
long anything took."""

from __future__ import annotations

import datetime
import io
import time
import types

import pytest
import torch

from harness import init_cgx, run_ranks, values

SECONDS = datetime.timedelta(seconds=1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _global_weights(diloco) -> torch.Tensor:
    return torch.cat([m.global_weight.reshape(-1).clone() for f in diloco._fragments.all for m in f.members])


def _step(model, inner, rank: int, step: int, pause_s: float) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    time.sleep(pause_s)
    inner.step()
    inner.zero_grad()


# ---- the weighing, against exact DiLoCo written out


def _weighed(rank, world, pauses):
    """Exact DiLoCo with outer_lr=1 and no momentum, one fragment, no overlap: after each
    sync the global weights are the replicas' local weights averaged, weighed by the
    inner steps each took since the last sync. Returns, per sync, this rank's inner step
    and local weights where it started, and the global weights after it."""
    import cgx

    init_cgx(rank, world)
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    before = {}
    inner.register_step_post_hook(lambda *_: before.update(local=_flat(model)))  # runs before DiLoCo's hook
    diloco = cgx.DiLoCo(model, inner, sync_every=0.2 * SECONDS, bits=32, outer_lr=1.0, outer_momentum=0.0,
                        nesterov=False)
    syncs, step = [], 0
    while diloco.syncs_started < 6:
        _step(model, inner, rank, step, pauses[rank])
        step += 1
        if len(syncs) < diloco.syncs_started:
            syncs.append((step, before["local"], _global_weights(diloco)))
    diloco.close()
    return syncs


def test_a_sync_weighs_each_replica_by_its_inner_steps():
    per_rank = values(run_ranks(_weighed, 3, args=([0.004, 0.012, 0.03],)))
    previous = [0] * 3
    unequal = 0
    for k in range(6):
        steps = [syncs[k][0] - previous[r] for r, syncs in enumerate(per_rank)]
        previous = [syncs[k][0] for syncs in per_rank]
        unequal += len(set(steps)) > 1
        expected = sum(n * syncs[k][1] for n, syncs in zip(steps, per_rank)) / sum(steps)
        got = [syncs[k][2] for syncs in per_rank]
        assert all(torch.equal(g, got[0]) for g in got)  # bit-identical on every replica
        torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-6)
        plain = sum(syncs[k][1] for syncs in per_rank) / 3
        assert len(set(steps)) == 1 or not torch.allclose(got[0], plain, rtol=0, atol=1e-6)
    assert unequal >= 3  # the replicas' speeds differ 7x: their steps did


# ---- bit-identical global weights in every form


def _unequal(rank, world, options, pauses, syncs):
    import cgx

    init_cgx(rank, world)
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = dict(options)
    stop_s = options.pop("stop_s", 0.0)  # the slow replica stops that long at its 5th step
    retime = options.pop("retime", None)  # replica 0 alone sets this interval at its 5th step
    jump_s = options.pop("jump_s", 0.0)  # the slow replica's clock jumps that far forward at its 5th step
    if "top_k" in options:
        options["top_k"] = cgx.diloco.TopK(**options["top_k"])
    diloco = cgx.DiLoCo(model, inner, **options)
    applied, step = {}, 0  # syncs applied -> the global weights then (a step may apply two)
    started = time.monotonic()
    while diloco.syncs_started < syncs:
        _step(model, inner, rank, step, pauses[rank] + (stop_s if rank == 1 and step == 5 else 0.0))
        step += 1
        if retime is not None and rank == 0 and step == 5:
            diloco.sync_every = retime
        if jump_s and rank == 1 and step == 5:  # (a monotonic clock does not go back; forward, a VM's may)
            cgx.diloco.clock.time = types.SimpleNamespace(monotonic=lambda: time.monotonic() + jump_s)
        applied.setdefault(diloco.stats()["outer_syncs"], _global_weights(diloco))
    diloco.close()
    applied["closed"] = _global_weights(diloco)
    seconds_a_step = (time.monotonic() - started) / step
    return step, applied, {**diloco.stats(), "started": diloco.syncs_started, "seconds_a_step": seconds_a_step}


FORMS = {
    "dense 4 bits, overlap": dict(sync_every=0.25 * SECONDS, fragments=2, bits=4, overlap=1),
    "own sparse places": dict(sync_every=0.25 * SECONDS, fragments=2, bits=2, outer_lr=1.5, outer_momentum=0.0,
                              nesterov=False, top_k={"k": 4, "chunk": 64}),
    "shared sparse places, overlap": dict(sync_every=0.25 * SECONDS, fragments=2, bits=2, overlap=2, outer_lr=1.5,
                                          outer_momentum=0.0, nesterov=False,
                                          top_k={"k": 4, "chunk": 64, "shared": True}),
    "a replica stopped for 6 intervals": dict(sync_every=0.1 * SECONDS, fragments=2, bits=4, overlap=1, stop_s=0.6),
    "a replica's clock jumps 4 intervals ahead": dict(sync_every=0.25 * SECONDS, fragments=2, bits=4, overlap=1,
                                                      jump_s=1.0),
    "one replica retimed alone": dict(sync_every=0.25 * SECONDS, fragments=2, bits=4, overlap=1, retime=0.1 * SECONDS),
    "interval shorter than a step": dict(sync_every=datetime.timedelta(milliseconds=1), fragments=3, bits=4,
                                         overlap=1),
}


@pytest.mark.filterwarnings("ignore:cgx.DiLoCo. top_k with outer momentum")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_replicas_of_unequal_speed_keep_bit_identical_global_weights(form):
    short = form == "interval shorter than a step"
    pauses = [0.002, 0.02] if not short else [0.005, 0.05]  # one replica 10x slower
    results = values(run_ranks(_unequal, 2, args=(FORMS[form], pauses, 8)))
    (fast_steps, fast, stats), (slow_steps, slow, slow_stats) = results
    both = set(fast) & set(slow)
    assert len(both) >= 4 and all(torch.equal(fast[k], slow[k]) for k in both)
    assert stats["outer_syncs"] == stats["started"] == 8  # one a step at most: the loops stop at 8 alike
    # The fast replica trained on rather than wait for the slow one's steps; where a sync
    # is due at every step, each of its steps waits for the slow one's. That holds where the
    # slow replica's steps took well under the shortest interval: a machine loaded by other
    # work can stretch its steps past it (seen: 43 slow steps against 42 fast ones with 0.1 s
    # intervals), and then a sync is due at every step here too.
    shortest_s = min(FORMS[form]["sync_every"], FORMS[form].get("retime", SECONDS)).total_seconds()
    if short:
        assert fast_steps >= slow_steps
    elif slow_stats["seconds_a_step"] < shortest_s / 3:
        assert fast_steps > slow_steps, (fast_steps, slow_steps, slow_stats["seconds_a_step"])


# ---- the trained set changing during the run


def _unfreeze(rank, world, keyed):
    """Layer 2 frozen at the start is unfrozen (its param group added) once the replica
    has started 4 syncs ("sync"), or "apart": replica 0 after sync 6, replica 1 after
    sync 2, in other intervals, as where each keys it to its own inner step."""
    import cgx

    init_cgx(rank, world)
    model = _model()
    model[2].requires_grad_(False)
    inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=0.2 * SECONDS, fragments=2, bits=4, overlap=1)
    applied, step = {}, 0
    try:
        while diloco.syncs_started < 10:
            if not model[2].weight.requires_grad and diloco.syncs_started >= (4 if keyed == "sync" else [6, 2][rank]):
                model[2].requires_grad_(True)
                inner.add_param_group({"params": list(model[2].parameters())})
            _step(model, inner, rank, step, [0.002, 0.02][rank])
            step += 1
            applied.setdefault(diloco.stats()["outer_syncs"], _global_weights(diloco))
    except ValueError as e:
        return str(e)
    diloco.close()
    return applied, sorted(diloco.state_dict()["global_weights"])


def test_the_trained_set_changes_alike_when_keyed_to_the_sync_count_and_raises_when_not():
    (fast, synced), (slow, synced_too) = values(run_ranks(_unfreeze, 2, args=("sync",)))
    assert "2.weight" in synced and synced == synced_too  # layer 2 joined the synced set on both
    both = fast.keys() & slow.keys()
    assert len(both) >= 4 and all(torch.equal(fast[k], slow[k]) for k in both)
    for error in values(run_ranks(_unfreeze, 2, args=("apart",))):  # every rank, naming the parameter and the fix
        assert "train different parameters at sync number" in error and "'2.weight'" in error, error
        assert "key the change to DiLoCo.syncs_started" in error, error


# ---- checkpoint and resume


def _resume(rank, world):
    """A checkpoint with a sync in flight (overlap=1000: applied only when its fragment's
    next sync starts), loaded into a new DiLoCo, and 4 more syncs."""
    import cgx

    init_cgx(rank, world)

    def build():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, cgx.DiLoCo(model, inner, sync_every=0.2 * SECONDS, fragments=2, overlap=1000)

    model, inner, diloco = build()
    step = 0
    while diloco.syncs_started < 3:
        _step(model, inner, rank, step, 0.002 * (1 + 4 * rank))
        step += 1
    saved = io.BytesIO()
    state = diloco.state_dict()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": state}, saved)
    at_save = (_global_weights(diloco), diloco.step, diloco.syncs_started, len(state["in_flight"]))
    diloco.close()

    model, inner, diloco = build()
    saved.seek(0)
    checkpoint = torch.load(saved)
    model.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["inner"])
    diloco.load_state_dict(checkpoint["diloco"])
    at_load = (_global_weights(diloco), diloco.step, diloco.syncs_started)
    while diloco.syncs_started < 7:
        _step(model, inner, rank, step, 0.002 * (1 + 4 * rank))
        step += 1
    diloco.close()
    return at_save, at_load, _global_weights(diloco), diloco.stats()["outer_syncs"]


def test_a_checkpoint_with_a_sync_in_flight_resumes_and_replicas_stay_identical():
    results = values(run_ranks(_resume, 2))
    for at_save, at_load, _, outer_syncs in results:
        assert at_save[3] >= 1  # a sync was in flight
        assert torch.equal(at_save[0], at_load[0]) and at_save[1:3] == at_load[1:3]
        assert outer_syncs == 7  # the stats went on from the checkpoint's
    assert torch.equal(results[0][2], results[1][2])


# ---- replicas that end at different syncs; bad input


def _end_apart(rank, world):
    import cgx

    init_cgx(rank, world, timeout_s=60)
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = cgx.DiLoCo(model, inner, sync_every=0.1 * SECONDS, fragments=2, overlap=1)
    step = 0
    while diloco.syncs_started < 3 + rank:
        _step(model, inner, rank, step, 0.002)
        step += 1
    try:
        diloco.close()
        return "no error", ""
    except RuntimeError as e:
        return str(e), type(e).__name__


def test_replicas_that_end_at_different_syncs_raise_on_every_rank():
    for message, kind in values(run_ranks(_end_apart, 2)):
        assert "out of step" in message and "syncs_started" in message, message
        # From the rows or the call check, at once: not a CollectiveTimeoutError at the group's timeout.
        assert kind == "RuntimeError", (kind, message)


def _bad_input(rank, world):
    import cgx

    init_cgx(rank, world, timeout_s=20)
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for every in (datetime.timedelta(0), -SECONDS, "1s", 1.5):
        try:
            cgx.DiLoCo(model, inner, sync_every=every)
            messages.append(f"no error for {every!r}")
        except ValueError as e:
            messages.append(str(e))
    diloco = cgx.DiLoCo(model, inner, sync_every=SECONDS, fragments=2)
    for every in (4, datetime.timedelta(0)):
        try:
            diloco.sync_every = every
            messages.append(f"no error for {every!r}")
        except ValueError as e:
            messages.append(str(e))
    diloco.sync_every = 2 * SECONDS  # a time for a time: taken
    messages.append(str(diloco.sync_every))
    diloco.close()
    try:
        cgx.DiLoCo(model, inner, sync_every=SECONDS * (1 + rank))
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_bad_input_raises_value_error_naming_the_argument():
    expected = ["must be a time above zero", "must be a time above zero", "or a datetime.timedelta (a time), got '1s'",
                "or a datetime.timedelta (a time), got 1.5", "keeps the kind of schedule it was built with (a time)",
                "must be a time above zero", "0:00:02", "were given different settings: sync_every"]
    for messages in values(run_ranks(_bad_input, 2, timeout_s=60)):
        assert len(messages) == len(expected), messages
        for want, got in zip(expected, messages):
            assert want in got, (want, got)


# ---- the clock


def test_the_clock_numbers_syncs_from_its_anchor_and_keeps_their_place_when_retimed():
    from cgx.diloco.clock import SyncClock

    clock = SyncClock(4 * SECONDS, fragments=4)  # a sync every second
    clock.anchor(0, now=100.0)
    assert [clock.due(now) for now in (100.0, 100.99, 101.0, 103.5, 250.0)] == [0, 0, 1, 3, 150]
    assert clock.due(now=50.0) == 0  # a clock read before its anchor (never: monotonic) is not negative
    clock.retime(8 * SECONDS, started=3)  # from sync 3's deadline (103 s) on, one every 2 s
    assert clock.deadline(4) == 105.0 and clock.due(now=104.9) == 3 and clock.due(now=107.0) == 5
    clock.anchor(10, now=200.0)  # a resume: sync 11 one spacing from the load
    assert clock.due(now=201.0) == 10 and clock.due(now=202.0) == 11
