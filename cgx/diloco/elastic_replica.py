"""Elastic Streaming DiLoCo (cgx.DiLoCo with membership=): what a replica does when the
run's members change. A failure makes the members re-form and do again only what is left;
in each new round they compare positions and pick the reference, those that differ take
its layout and state point to point, and syncs in flight are settled. cgx.DiLoCo inherits
these methods (diloco.py); the pieces they work on are outer_sync.py's."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from cgx.diloco.outer_sync import _ROW, _SYNC, _Agreement, _local, _Replicas, _Sync, _trained
from cgx.elastic import Round
from cgx.errors import CallMismatchError, MembershipError

_log = logging.getLogger("cgx.diloco")


class ElasticReplica:
    """cgx.DiLoCo's methods for elastic runs; they use its state (a mixin)."""

    def _join_the_run(self) -> None:
        """The first round of this replica: the run's start, or a join (then the rest of
        the step the members are at). A failure in it re-forms, as in _with_recovery."""
        cause = None
        while True:
            try:
                took = self._enter_round(self._membership.round, cause=None) if cause is None else self._reform(cause)
                break
            except dist.DistError as e:
                if isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                cause = e
        if took:
            self._with_recovery(self._syncs_of_this_step)

    # ---- elastic runs: the replicas re-form

    def _with_recovery(self, action: Callable[[], Any]) -> Any:
        """Runs `action`. In an elastic run, where a collective fails (a replica died,
        left or lost its link: PeerError or CollectiveTimeoutError), in `action` or while
        the replicas re-form, the replicas re-form (:meth:`_reform`) and `action` runs
        again, doing what is left. A replica that took another's state and step first
        does the rest of that step's syncs, as the others do."""
        cause, catch_up = None, False
        while True:
            try:
                if cause is not None:
                    catch_up |= self._reform(cause)
                    cause = None
                if catch_up and action != self._syncs_of_this_step:
                    self._syncs_of_this_step()
                catch_up = False
                return action()
            except _TookState:
                catch_up = True
            except dist.DistError as e:
                if self._membership is None or isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                cause = e

    def _reform(self, cause: Exception | None) -> bool:
        """The members move to the next round: after a failure (`cause`), or to admit
        replicas waiting to join. The syncs in flight complete in the old round where
        they can; what the old round did not complete is done again in the new one.
        Returns whether this member took another's state (see :meth:`_enter_round`)."""
        started = time.perf_counter()
        for sync in self._in_flight:
            if sync.completed:
                continue
            try:
                if not sync.checked:
                    self._replicas.check(sync.agreement)
                    sync.checked = True
                sync.fragment.complete(sync, self._replicas)
            except dist.DistError:
                if cause is None:
                    cause = sys.exc_info()[1]
        if cause is not None:
            cause = cause.__cause__ or cause  # the backend's own words, without DiLoCo's out-of-step advice
            _log.warning("cgx.DiLoCo: run %r: a collective failed at inner step %d (%s: %s); the replicas re-form",
                         self._membership.run_id, self.step, type(cause).__name__, cause)
        took = self._enter_round(self._membership.next_round(), cause)
        self._elastic_stats["reform_seconds"] += time.perf_counter() - started
        return took

    def _enter_round(self, round_: Round, cause: Exception | None) -> bool:
        """This replica's part in forming `round_`, alike on every member. Everyone shows
        its position (all_gather_object). A replica built otherwise than the run is
        refused (ValueError on it; the others form the round again without it). Where no
        member holds the run's state yet, the run starts (:meth:`_start_together`). Else
        the reference is the member with the most syncs applied (then the latest step,
        then the lowest rank): every replica whose state differs from it (a joiner; a
        member that missed a sync the reference applied) takes the reference's global
        weights, outer momentum, frozen parameters (sent to it alone), schedule and
        syncs in flight, and restarts its local weights from them. The syncs the reference completed are
        given to whoever lacks them; the others are done again, averaged over the members
        that sent into them. Returns whether this replica took the reference's state."""
        while True:
            previous = self._replicas
            self._replicas = _Replicas.of_round(round_)
            self._replicas.stats = previous.stats  # residuals start over: they belong to a rank of a round
            positions = self._replicas.all_gather_object(self._position())
            refused = _refused(positions)
            if not refused:
                break
            me = self._replicas.rank
            if me in refused:
                self._closed = True
                self._hook.remove()
                self._membership.close()
                raise ValueError(f"cgx.DiLoCo: run {self._membership.run_id!r} refused this replica: {refused[me]}; "
                                 f"every replica must build DiLoCo alike on the same model")
            for rank, difference in refused.items():
                _log.warning("cgx.DiLoCo: run %r refused replica %s: %s", self._membership.run_id,
                             positions[rank]["id"], difference)
            round_ = self._membership.next_round()
        ids = [p["id"] for p in positions]
        self._weights_changed = True
        self._count_members(ids, cause)
        if not any(p["established"] for p in positions):
            if any(p["step"] > 0 for p in positions):
                raise MembershipError(
                    f"cgx.DiLoCo: run {self._membership.run_id!r}: every replica holding the run's state is gone "
                    f"(the others had not finished taking it); restart the run from a checkpoint")
            self._start_together()
            self._established = True
            return False
        reference = max((r for r, p in enumerate(positions) if p["established"]),
                        key=lambda r: (sum(positions[r]["syncs"]), positions[r]["step"], -r))
        takers = [r for r, p in enumerate(positions) if p["state"] != positions[reference]["state"]]
        me = self._replicas.rank
        if me in takers:
            self._established = False  # until the state has arrived: never a reference half-taken
            self._take_position(positions[reference])
        if takers:
            frozen = positions[reference]["layout"]["frozen"]
            self._elastic_stats["bytes_to_joiners"] += self._replicas.send(self._state_tensors(frozen), reference, takers)
            if me in takers:
                self._restart_local_weights()
        self._settle_in_flight(positions, reference, takers)
        self._established = True
        self._took_state |= me in takers
        return me in takers

    def _position(self) -> dict[str, Any]:
        """What this replica shows the others when a round forms."""
        layout = self._layout()
        digest = hashlib.blake2b(repr((self.step, layout)).encode(), digest_size=16)
        for t in self._state_tensors(layout["frozen"]) if self._established else ():
            digest.update(_local(t).detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
        return {
            "id": self._membership.replica_id,
            "established": self._established,
            "construction": {**dataclasses.asdict(self._schedule),
                             "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._model.named_parameters()],
                             # Every parameter's, frozen or not: the run may have unfrozen some.
                             "settings": [(n, self._member_setting(n, p)) for n, p in self._model.named_parameters()],
                             "trained parameters": _trained(self._model, self._optimizer)[0]},
            "step": self.step,
            "syncs": [f.syncs for f in self._fragments],
            "state": digest.hexdigest() if self._established else None,
            "layout": layout,
            "in_flight": [{"key": s.key, "completed": s.completed, "sent": s.sent is not None}
                          for s in self._in_flight],
        }

    def _layout(self) -> dict[str, Any]:
        """The run's state but its tensors: what a replica taking it needs."""
        return {
            "fragments": [f.names for f in self._fragments],
            "offsets": [f.offset for f in self._fragments],  # fixed at construction (sync_every may change)
            "syncs": [f.syncs for f in self._fragments],
            "last_start": [f.last_start for f in self._fragments],
            "momentum": [sorted(f.outer_momentum()) if f.outer is not None else [] for f in self._fragments],
            # In the order members join a fragment (model order, as _follow adds them).
            "joining": [(name, index) for name, (index, _) in self._joining.items()],
            "leaving": sorted(self._leaving),
            "in_flight": [(s.key, s.agreement.trained) for s in self._in_flight],
            "frozen": self._frozen(),
        }

    def _frozen(self) -> list[str]:
        """The parameters neither synced nor trained here: equal on every replica."""
        synced = {m.name for f in self._fragments for m in f.members} | set(self._joining)
        synced |= {name for name, _ in _trained(self._model, self._optimizer)[0]}
        return [name for name, _ in self._model.named_parameters() if name not in synced]

    def _state_tensors(self, frozen: list[str]) -> list[torch.Tensor]:
        """The run's state that a replica taking it receives, in an order every replica
        with the same layout shares: global weights, outer momentum buffers, and the
        `frozen` parameters (the reference's list)."""
        members = [m for f in self._fragments for m in f.members]
        members += [self._joining[name][1] for name in sorted(self._joining)]
        momentum = [f.outer.state[m.global_weight]["momentum_buffer"] for f in self._fragments for m in f.members
                    if f.outer is not None and f.outer.state[m.global_weight].get("momentum_buffer") is not None]
        params = dict(self._model.named_parameters())
        return [m.global_weight for m in members] + momentum + [params[name] for name in frozen]

    def _take_position(self, reference: dict[str, Any]) -> None:
        """Takes the reference's layout, schedule and syncs in flight (the tensors follow
        by broadcast). A sync in flight here that the reference also has keeps what this
        replica sent into it, so that it can be done again with it."""
        layout = reference["layout"]
        params = dict(self._model.named_parameters())
        mine = {s.key: s for s in self._in_flight}
        with torch.no_grad():
            for fragment, names, offset, syncs, last_start, momentum in zip(
                    self._fragments, layout["fragments"], layout["offsets"], layout["syncs"], layout["last_start"],
                    layout["momentum"]):
                fragment.set_members([self._member(n, params[n]) for n in names], self._schedule.outer_options,
                                     momentum={})
                fragment.offset, fragment.syncs, fragment.last_start = offset, syncs, last_start
                for m in fragment.members:
                    if m.name in momentum:
                        fragment.outer.state[m.global_weight] = {"momentum_buffer": torch.zeros_like(m.global_weight)}
            self._joining = {name: (index, self._member(name, params[name])) for name, index in layout["joining"]}
        self._leaving = set(layout["leaving"])
        self.step = reference["step"]
        self._in_flight = []
        for key, trained in layout["in_flight"]:
            index, start, due = key
            fragment = self._fragments[index]
            own = mine.get(tuple(key))
            sent = own.sent if own is not None and own.sent is not None and own.sent.numel() == fragment.numel else None
            device = fragment.members[0].global_weight.device if fragment.members else torch.device("cpu")
            gradient = torch.zeros(fragment.numel, device=device) if fragment.members else None
            agreement = _Agreement(_SYNC, start, trained, torch.zeros(1, _ROW), None)
            self._in_flight.append(_Sync(fragment, due, agreement, gradient, None, None, sent, checked=True))

    def _restart_local_weights(self) -> None:
        with torch.no_grad():
            for m in [m for f in self._fragments for m in f.members] + [m for _, m in self._joining.values()]:
                _local(m.param).copy_(m.global_weight)

    def _settle_in_flight(self, positions: list[dict[str, Any]], reference: int, takers: list[int]) -> None:
        """The syncs in flight, as the reference has them: the averages it completed are
        sent to every member that lacks them; the syncs it did not complete are done again in
        this round, each member sending what it sent before (scaled, so that the average
        is over those that sent) or zeros. Residuals from the old round are dropped."""
        size = self._replicas.size
        theirs = [{tuple(e["key"]): e for e in p["in_flight"]} for p in positions]
        again = []
        for i, entry in enumerate(positions[reference]["in_flight"]):
            key = tuple(entry["key"])
            sync = self._in_flight[i]
            sync.residual = None
            if entry["completed"]:
                lacking = [r for r in range(size) if r in takers or not theirs[r][key]["completed"]]
                if lacking and sync.outer_gradient is not None:
                    self._replicas.send([sync.outer_gradient], reference, lacking)
                sync.work, sync.agreement.work, sync.checked = None, None, True
            else:
                again.append((i, sum(1 for r in range(size) if key in theirs[r] and theirs[r][key]["sent"])))
        for i, senders in again:
            old = self._in_flight[i]
            fragment = old.fragment
            delta = None
            if fragment.members:
                delta = (old.sent * (size / senders) if old.sent is not None
                         else torch.zeros(fragment.numel, device=fragment.members[0].global_weight.device))
            sync = fragment.start(self._replicas, old.agreement.step, old.due, self.error_feedback,
                                  old.agreement.trained, 0, delta=delta)
            sync.sent = old.sent
            self._in_flight[i] = sync
            self._elastic_stats["syncs_redone"] += 1

    def _count_members(self, ids: list[str], cause: Exception | None) -> None:
        """Counts and logs the replicas that are gone from, or new in, the round."""
        stats = self._elastic_stats
        stats["rounds"] += 1
        if self._ids:
            run = self._membership.run_id
            for gone in sorted(set(self._ids) - set(ids)):
                stats["replicas_lost"] += 1
                _log.warning("cgx.DiLoCo: run %r: replica %s is gone (%s); %d replicas go on", run, gone,
                             "it left or died" if cause is None else f"{type(cause).__name__}: {cause}", len(ids))
            for new in sorted(set(ids) - set(self._ids)):
                stats["replicas_joined"] += 1
                _log.info("cgx.DiLoCo: run %r: replica %s joined; %d replicas", run, new, len(ids))
        self._ids = ids


class _TookState(Exception):
    """This replica took another's state and step as the round formed: the step's syncs
    run again from the top (as that member has them)."""


def _refused(positions: list[dict[str, Any]]) -> dict[int, str]:
    """The ranks of a forming round whose DiLoCo is built otherwise than the run's (its
    members' with the lowest rank), each with the first difference. None are refused at
    the run's start: there every rank fails (_agree_on_construction)."""
    established = [r for r, p in enumerate(positions) if p["established"]]
    if not established:
        return {}
    run = positions[min(established)]["construction"]
    refused = {}
    for rank, position in enumerate(positions):
        for name, value in run.items():
            theirs = position["construction"].get(name)
            if theirs == value:
                continue
            if isinstance(value, list) and isinstance(theirs, list):  # name the entries that differ
                only_here = [x for x in theirs if x not in value][:2]
                only_run = [x for x in value if x not in theirs][:2]
                refused[rank] = (f"its {name} differ from the run's: it has {only_here or 'nothing more'}, "
                                 f"the run {only_run or 'nothing more'}")
            else:
                refused[rank] = f"its {name} differ from the run's: {theirs!r} against {value!r}"
            break
    return refused

