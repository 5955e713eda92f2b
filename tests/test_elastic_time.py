"""Elastic DiLoCo under the time schedule (sync_every a datetime.timedelta), replicas
of unequal speed: a kill and a joiner (dense and shared-places sparse), a replica that
leaves, and an elastic run's checkpoints with a sync in flight resumed in a new run.
Real processes, on the membership helpers of test_elastic.py (a file of its own so that
pytest-xdist's loadfile runs it beside that file, not after it)."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch

from harness import run_ranks, values
from test_elastic import (_free_port, _global_digest, _host_stays_until_the_others_are_done, _membership,
                          _rendezvous_store)


def _elastic_replica_by_time(replica, replicas, port, run_id, sparse, how):
    """test_elastic.py's kill-and-rejoin run under the time schedule, the replicas of
    unequal speed (replica 1 five times slower than replica 0). `how` "kill": replica 2 kills itself once it has
    started sync 4, replica 3 joins once it is dead; "leave": replica 2 calls leave()
    there, and nobody joins. Each records the digest of its global weights by the syncs
    its fragments applied in all (alike on every replica holding the run's state; taking
    it calls state_dict(), which waits for the syncs in flight). The run ends at the
    first sync from 12 on where the joiner is in it (or replica 2 is out of it)."""
    import signal

    import cgx
    from test_diloco import _model, _train_step

    if replica == 3:
        _rendezvous_store(port).wait(["killed"])
    model = _model(replica)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    membership = _membership(replica, port, run_id, starting=3, min_replicas=2)
    compression = dict(bits=2, top_k=cgx.diloco.TopK(k=4, chunk=64, shared=sparse == "shared")) if sparse else dict(
        bits=4)
    diloco = cgx.DiLoCo(model, inner, sync_every=datetime.timedelta(seconds=0.4), fragments=2, overlap=1,
                        membership=membership, **compression)
    if replica == 2 and how == "kill":
        def die(*_):
            if diloco.syncs_started >= 4:
                _rendezvous_store(port).set("killed", "1")
                os.kill(os.getpid(), signal.SIGKILL)
        inner.register_step_pre_hook(die)
    digests = {}

    def joiner_is_in() -> bool:
        stats = diloco.stats()
        if how == "leave":
            return stats["replicas"] == 2
        return stats["replicas"] == 3 and (replica == 3 or stats["replicas_joined"] >= 1)

    while diloco.syncs_started < 12 or not joiner_is_in():
        if replica == 2 and how == "leave" and diloco.syncs_started >= 4:
            diloco.leave()
            membership.close()
            _host_stays_until_the_others_are_done(replica, [1, 2], port, run_id)
            return digests, {**diloco.stats(), "started": diloco.syncs_started}
        _train_step(model, inner, replica, diloco.step)
        time.sleep([0.004, 0.02, 0.008, 0.01][replica])
        digests.setdefault(sum(f.syncs for f in diloco._fragments), _global_digest(diloco))
    diloco.close()
    digests["end"] = _global_digest(diloco)
    stats = {**diloco.stats(), "started": diloco.syncs_started}
    membership.close()
    _host_stays_until_the_others_are_done(replica, [1, 2] if how == "leave" else [1, 3], port, run_id)
    return digests, stats


@pytest.mark.parametrize("sparse,how", [(False, "kill"), ("shared", "kill"), (False, "leave")],
                         ids=["dense", "shared-places", "leave"])
def test_diloco_by_time_goes_on_without_a_killed_replica_and_takes_a_joiner(sparse, how):
    port = _free_port()
    results = run_ranks(_elastic_replica_by_time, 4 if how == "kill" else 3,
                        args=(port, f"time-{how}-{sparse}", sparse, how), expect_exit={2} if how == "kill" else set(),
                        timeout_s=240)
    (d0, stats0), (d1, stats1) = results[:2]
    both = d0.keys() & d1.keys()
    assert len(both) >= 8 and all(d0[k] == d1[k] for k in both)  # the survivors bit-identical, sync by sync
    assert d0["end"] == d1["end"] and stats0["started"] == stats1["started"] >= 12
    assert stats0["step"] > stats1["step"]  # the fast replica trained on: it did not wait for the slow one
    if how == "leave":
        d2, stats2 = results[2]
        assert all(d2[k] == d0[k] for k in d2.keys() & d0.keys()) and len(d2.keys() & d0.keys()) >= 2
        assert stats2["started"] >= 4
        for stats in (stats0, stats1):
            assert stats["replicas"] == 2 and stats["replicas_lost"] >= 1, stats
        return
    assert results[2] is None
    d3, stats3 = results[3]
    assert d3.keys() & d0.keys() and all(d3[k] == d0[k] for k in d3.keys() & d0.keys()), "the joiner differs"
    assert d3["end"] == d0["end"]
    assert stats0["started"] == stats3["started"]
    for stats in (stats0, stats1):
        assert stats["replicas_lost"] == 1 and stats["replicas_joined"] == 1 and stats["replicas"] == 3, stats
    assert stats3["rounds"] == 1 and stats3["replicas"] == 3, stats3


def _resume_by_time(replica, replicas, port):
    """Replicas 0 and 1 of an elastic run under the time schedule (replica 1 five times
    slower) save a checkpoint with a sync in flight (overlap=1000: applied only when its
    fragment's next sync starts) at sync 3 and close; both start again in a new run (a new
    run_id on the same store), load their checkpoints and go on to sync 7."""
    import io

    import cgx
    from test_diloco import _model, _train_step

    def build(run_id):
        model = _model(replica)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        membership = _membership(replica, port, run_id, starting=2, min_replicas=2)
        return model, inner, membership, cgx.DiLoCo(model, inner, sync_every=datetime.timedelta(seconds=0.2),
                                                    fragments=2, bits=4, overlap=1000, membership=membership)

    def train_to(sync):
        while diloco.syncs_started < sync:
            _train_step(model, inner, replica, diloco.step)
            time.sleep([0.002, 0.01][replica])

    model, inner, membership, diloco = build("resume-by-time")
    train_to(3)
    state = diloco.state_dict()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": state}, saved)
    at_save = (_global_digest(diloco), diloco.step, diloco.syncs_started, len(state["in_flight"]))
    diloco.close()
    membership.close()
    _host_stays_until_the_others_are_done(replica, [1], port, "resume-by-time")

    model, inner, membership, diloco = build("resume-by-time-again")
    saved.seek(0)
    checkpoint = torch.load(saved)
    model.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["inner"])
    diloco.load_state_dict(checkpoint["diloco"])
    at_load = (_global_digest(diloco), diloco.step, diloco.syncs_started)
    train_to(7)
    diloco.close()
    result = at_save, at_load, _global_digest(diloco), diloco.syncs_started, diloco.stats()["outer_syncs"]
    membership.close()
    _host_stays_until_the_others_are_done(replica, [1], port, "resume-by-time-again")
    return result


def test_diloco_by_time_resumes_an_elastic_run_from_checkpoints_with_a_sync_in_flight():
    results = values(run_ranks(_resume_by_time, 2, args=(_free_port(),), timeout_s=180))
    for at_save, at_load, _, started, outer_syncs in results:
        assert at_save[3] >= 1  # a sync was in flight
        assert at_save[:3] == at_load  # the global weights bit for bit, the step, the sync number
        assert started == outer_syncs == 7  # the stats went on from the checkpoint's
    assert results[0][2] == results[1][2]  # bit-identical at the end
    assert results[0][1][1] > results[1][1][1]  # replica 1 was slower: the replicas' steps differ
