"""An elastic run's recovery (cgx.DiLoCo with membership=): what a replica does when the
run's members change. A failure makes the members re-form and do again only what is left;
in each new round they compare positions and pick the reference, those that differ take
its layout and state point to point, and syncs in flight are settled. DiLoCo holds one
Recovery, and gives it what it may read and set of DiLoCo's state as a
:class:`Recoverable` (the seam between the two: recovery knows DiLoCo by nothing else)."""

from __future__ import annotations

import collections
import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError

from cgx.diloco.replicas import LEFT_OUT, READY, Replicas
from cgx.diloco.syncs import Sync
from cgx.diloco.tensors import local
from cgx.elastic import Membership, Round
from cgx.errors import CallMismatchError, MembershipError

_log = logging.getLogger("cgx.diloco")


@dataclass(frozen=True)
class Recoverable:
    """What recovery reads and sets of a replica's DiLoCo, and nothing more: DiLoCo
    gives one as it builds its Recovery (holding DiLoCo weakly, so that a DiLoCo dropped
    without close() is freed at once, and its membership's heartbeats stop with it)."""

    step: Callable[[], int]  # the inner step
    # Where the replica is in the run's schedule, alike on its members: the inner step, or
    # under a time schedule the number of the last sync started (inner steps differ there).
    position: Callable[[], int]
    next_sync_in: Callable[[], float | None]  # time schedule: seconds to the next sync's deadline
    error_feedback: Callable[[], bool]
    replicas: Callable[[], Replicas]  # the current round's
    use_replicas: Callable[[Replicas], None]  # syncs go to these from now on (residuals start over)
    in_flight: Callable[[], list[Sync]]  # the syncs in flight, in start order (the list itself)
    construction: Callable[[], dict[str, Any]]  # what every replica must build alike
    layout: Callable[[], dict[str, Any]]  # the run's state but its tensors (its syncs in flight too)
    state_tensors: Callable[[list[str]], list[torch.Tensor]]  # the state's tensors, the given frozen ones last
    # another's layout, position and next_sync_in (the tensors follow)
    take_layout: Callable[[dict[str, Any], int, float | None], None]
    restart_local_weights: Callable[[], None]  # from the global weights
    start_together: Callable[[], None]  # the run's start, on every replica of the round
    syncs_of_this_step: Callable[[], list[list[int]]]  # what is left of this step's syncs; their rows' joiners
    stop: Callable[[], None]  # trains on without syncing (this replica was refused)


class Recovery:
    """The recovery of one replica of an elastic run: the rounds it is in, its position
    in each, the state it takes or sends, the syncs it does again, and their stats."""

    def __init__(self, diloco: Recoverable, membership: Membership) -> None:
        self._diloco = diloco
        self.membership = membership
        self.established = False  # holds the run's state (the run started with it, or it took it)
        self.took_state = False  # took it from a live member: a checkpoint would set it apart
        self._ids: list[str] = []  # the replicas of the current round, by Membership.replica_id
        self.stats = {"rounds": 0, "replicas_lost": 0, "replicas_joined": 0, "syncs_redone": 0,
                      "reform_seconds": 0.0, "bytes_to_joiners": 0}

    def first_replicas(self) -> Replicas:
        """The replicas of the round this replica starts in (formed here if none is; where
        a member is lost as it forms, its backend fails to connect: formed again, until
        the membership's join_timeout has passed: a replica whose rounds keep failing
        would cost the members a round each time)."""
        membership = self.membership
        deadline = time.monotonic() + membership.join_timeout.total_seconds()
        while membership.round is None:
            try:
                membership.next_round()
            except dist.DistError as e:
                if isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                if time.monotonic() > deadline:
                    raise MembershipError(f"cgx.DiLoCo: run {membership.run_id!r}: no first round formed within "
                                          f"join_timeout={membership.join_timeout}; the last attempt failed with "
                                          f"{type(e).__name__}: {e}") from e
                _log.warning("cgx.DiLoCo: run %r: the first round failed as it formed (%s: %s); it forms again",
                             membership.run_id, type(e).__name__, e)
        return Replicas.of_round(membership.round)

    def join(self) -> None:
        """The first round of this replica: the run's start, or a join (then the rest of
        the step the members are at). A failure in it re-forms, as in :meth:`run`."""
        cause = None
        while True:
            try:
                took = self._enter_round(self.membership.round, cause=None) if cause is None else self._reform(cause)
                break
            except dist.DistError as e:
                if isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                cause = e
        if took:
            self.run()

    def run(self, action: Callable[[], Any] | None = None) -> Any:
        """Runs `action`, or, by default, this step's syncs and the admission their rows
        ask for (:meth:`admit`). Where a collective fails (a replica died, left or lost
        its link: PeerError or CollectiveTimeoutError), in `action` or while the replicas
        re-form, the replicas re-form (:meth:`_reform`) and `action` runs again, doing
        what is left. A replica that took another's state and step first does the rest
        of that step's syncs, as the others do."""
        cause, catch_up = None, False
        while True:
            try:
                if cause is not None:
                    catch_up |= self._reform(cause)
                    cause = None
                if catch_up and action is not None:
                    self._syncs_of_this_step()
                catch_up = False
                return self._syncs_of_this_step() if action is None else action()
            except TookState:
                catch_up = True
            except dist.DistError as e:
                if isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                cause = e

    def _syncs_of_this_step(self) -> None:
        self.admit(self._diloco.syncs_of_this_step())

    def joining(self, replicas: int) -> int:
        """What this replica's row of a sync says of joiners: how many wait to join (none
        where the round is full: a joiner waits for a place), or, while the round that
        admits them forms beside training, READY once it has formed here, LEFT_OUT where
        torch's rendezvous formed it without this replica."""
        membership = self.membership
        if membership.next_round_preparing:
            if membership.next_round_formed:
                return READY
            return LEFT_OUT if membership.left_out_of_next_round else 0
        joiners = membership.joiners_waiting()
        return min(0 if joiners and replicas >= membership.max_replicas else joiners, LEFT_OUT - 1)

    def admit(self, rows: list[list[int]]) -> None:
        """Admits joiners, by what the syncs just checked say (`rows`: each sync's
        replicas' joining() values; every member holds the same): where a member saw
        joiners waiting, the members start forming the round that admits them beside
        training (Membership.prepare_next_round); where a member was left out of it, they
        form it again, with it; else, where every member's round has formed, they move to
        it together. Raises TookState where this replica took another's state there (its
        step's syncs run again)."""
        if not self.membership.next_round_preparing:
            if any(0 < v < LEFT_OUT for row in rows for v in row):
                self.membership.prepare_next_round()
            return
        left_out = sorted({rank for row in rows for rank, v in enumerate(row) if v == LEFT_OUT})
        if left_out:
            self.membership.form_next_round_again(left_out)
        elif any(row and all(v == READY for v in row) for row in rows):
            if self._reform(cause=None):
                raise TookState

    def leave(self) -> None:
        self.membership.close()

    def end_run(self) -> None:
        """The members agreed to end (DiLoCo.close()): the run ends for every replica."""
        try:
            self.membership.end_run()
        except (MembershipError, RendezvousError) as e:
            _log.info("cgx.DiLoCo: run %r: could not end the run on the rendezvous (%s: %s); a replica that comes "
                      "back waits for a round until its join_timeout", self.membership.run_id, type(e).__name__, e)

    # ---- the replicas re-form

    def _reform(self, cause: Exception | None) -> bool:
        """The members move to the next round: after a failure (`cause`), or to admit
        replicas waiting to join. The syncs in flight complete in the old round where
        they can; what the old round did not complete is done again in the new one.
        Returns whether this member took another's state (see :meth:`_enter_round`)."""
        started = time.perf_counter()
        try:
            return self._move_to_the_next_round(cause)
        finally:  # a failed attempt counts too: its time was spent
            self.stats["reform_seconds"] += time.perf_counter() - started

    def _move_to_the_next_round(self, cause: Exception | None) -> bool:
        diloco = self._diloco
        replicas = diloco.replicas()
        for sync in diloco.in_flight():
            if sync.completed:
                continue
            try:
                if not sync.checked:
                    replicas.check(sync.agreement)
                    sync.checked = True
                sync.complete(replicas)
            except dist.DistError:
                if cause is None:
                    cause = sys.exc_info()[1]
        if cause is not None:
            cause = cause.__cause__ or cause  # the backend's own words, without DiLoCo's out-of-step advice
            _log.warning("cgx.DiLoCo: run %r: a collective failed at inner step %d (%s: %s); the replicas re-form",
                         self.membership.run_id, diloco.step(), type(cause).__name__, cause)
        # A roll call is for those holding the run's state: a joiner that has not taken it
        # yet (its members were slow to move to its round, or died) asks the rendezvous
        # again, never going on without them (it would start a run of its own).
        after_failure = cause is not None and self.established
        return self._enter_round(self.membership.next_round(after_failure=after_failure), cause)

    def _enter_round(self, round_: Round, cause: Exception | None) -> bool:
        """This replica's part in forming `round_`, alike on every member. Everyone shows
        its position (all_gather_object). A replica built otherwise than the run is
        refused (ValueError on it; the others form the round again without it). Where no
        member holds the run's state yet, the run starts (DiLoCo._start_together). Else
        the reference is the member with the most syncs applied (then the latest step,
        then the state most of those hold, then the lowest rank): every replica whose state differs from it (a joiner; a
        member that missed a sync the reference applied) takes the reference's global
        weights, outer momentum, frozen parameters (sent to it alone), schedule and
        syncs in flight, and restarts its local weights from them. The syncs the reference completed are
        given to whoever lacks them; the others are done again, averaged over the members
        that sent into them. Returns whether this replica took the reference's state."""
        diloco = self._diloco
        waiting_since = None  # for the replicas holding the run's state
        while True:
            replicas = Replicas.of_round(round_)
            diloco.use_replicas(replicas)
            positions = replicas.all_gather_object(self._position())
            refused = _refused(positions)
            if not refused and _holders_elsewhere(positions):
                waiting_since = self._wait_for_holders(waiting_since)
                round_ = self.membership.next_round()
                continue
            if not refused:
                break
            me = replicas.rank
            if me in refused:
                diloco.stop()
                self.membership.close()
                raise ValueError(f"cgx.DiLoCo: run {self.membership.run_id!r} refused this replica: {refused[me]}; "
                                 f"every replica must build DiLoCo alike on the same model")
            for rank, difference in refused.items():
                _log.warning("cgx.DiLoCo: run %r refused replica %s: %s", self.membership.run_id,
                             positions[rank]["id"], difference)
            round_ = self.membership.next_round()
        self._count_members([p["id"] for p in positions], cause)
        if not any(p["established"] for p in positions):
            if any(p["position"] > 0 for p in positions):
                raise MembershipError(
                    f"cgx.DiLoCo: run {self.membership.run_id!r}: every replica holding the run's state is gone "
                    f"(the others had not finished taking it); restart the run from a checkpoint")
            diloco.start_together()
            if replicas.rank == 0:
                self.membership.mark_run_started()
            self.established = True
            return False
        reference = _reference(positions)
        takers = [r for r, p in enumerate(positions) if p["state"] != positions[reference]["state"]]
        me = replicas.rank
        # A member as far as the reference with other weights diverged: what it sent into
        # the syncs in flight came from those weights, so it sends zeros when they are
        # done again, and the average is over the others.
        for r in takers:
            if positions[r]["established"] and _progress(positions[r]) == _progress(positions[reference]):
                _log.warning("cgx.DiLoCo: run %r: replica %s diverged (its state differs from replica %s's at the "
                             "same sync); it takes that state", self.membership.run_id, positions[r]["id"],
                             positions[reference]["id"])
                for entry in positions[r]["in_flight"]:
                    entry["sent"] = False
                if r == me:
                    for sync in diloco.in_flight():
                        sync.sent = None
        if me in takers:
            self.established = False  # until the state has arrived: never a reference half-taken
            diloco.take_layout(positions[reference]["layout"], positions[reference]["position"],
                               positions[reference]["next_sync_in"])
        if takers:
            frozen = positions[reference]["layout"]["frozen"]
            self.stats["bytes_to_joiners"] += replicas.send(diloco.state_tensors(frozen), reference, takers)
            if me in takers:
                diloco.restart_local_weights()
        self._settle_in_flight(positions, reference, takers)
        self.established = True
        self.took_state |= me in takers
        return me in takers

    def _position(self) -> dict[str, Any]:
        """What this replica shows the others when a round forms."""
        diloco = self._diloco
        layout = diloco.layout()
        position = diloco.position()
        digest = hashlib.blake2b(repr((position, layout)).encode(), digest_size=16)
        for t in diloco.state_tensors(layout["frozen"]) if self.established else ():
            digest.update(local(t).detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
        return {
            "id": self.membership.replica_id,
            "established": self.established,
            "construction": diloco.construction(),
            "position": position,
            "next_sync_in": diloco.next_sync_in(),  # read after the digest: it differs between replicas
            "syncs": layout["syncs"],
            "state": digest.hexdigest() if self.established else None,
            "layout": layout,
            "in_flight": [{"key": s.key, "completed": s.completed, "sent": s.sent is not None}
                          for s in diloco.in_flight()],
            "run_started": self.membership.run_started,  # read before any member of this round marks it
        }

    def _wait_for_holders(self, since: float | None) -> float:
        """This round holds none of the run's state, but the run started: its holders
        are out of it (re-forming, waiting in a collective for a dead peer, or gone).
        Starting the run again here would train from scratch and then hand that to them;
        instead these replicas form again until a round holds a holder, up to
        join_timeout from the first such round. Returns when that wait began."""
        now = time.monotonic()
        limit = self.membership.join_timeout
        if since is None:
            _log.warning("cgx.DiLoCo: run %r: a round formed without any replica holding the run's state (they are "
                         "re-forming or gone); it forms again until one holds it, up to join_timeout=%s",
                         self.membership.run_id, limit)
            return now
        if now - since > limit.total_seconds():
            raise MembershipError(
                f"cgx.DiLoCo: run {self.membership.run_id!r} has started, but no replica holding its state came to "
                f"a round within join_timeout={limit}: they are gone. Restart the run from a checkpoint under a new "
                f"run_id (this one's rendezvous store says it started; its state is lost with its replicas)")
        return since

    def _settle_in_flight(self, positions: list[dict[str, Any]], reference: int, takers: list[int]) -> None:
        """The syncs in flight, as the reference has them: the averages it completed are
        sent to every member that lacks them; the syncs it did not complete are done again in
        this round, each member sending what it sent before, weighing what it weighed then
        (syncs.Weight), or zeros, weighing nothing: the average is over those that sent. Residuals
        from the old round are dropped, but those of syncs with own sparse places: what
        this rank did not send, its own, set as the sync started (dropped, the residual
        from before it would send again what it sent)."""
        diloco = self._diloco
        replicas, in_flight = diloco.replicas(), diloco.in_flight()
        size = replicas.size
        theirs = [{tuple(e["key"]): e for e in p["in_flight"]} for p in positions]
        again = []
        for i, entry in enumerate(positions[reference]["in_flight"]):
            key = tuple(entry["key"])
            sync = in_flight[i]
            sync.keep_residual_at_reform()
            if entry["completed"]:
                lacking = [r for r in range(size) if r in takers or not theirs[r][key]["completed"]]
                if lacking and sync.outer_gradient is not None:
                    replicas.send([sync.outer_gradient], reference, lacking)
                sync.work, sync.agreement.work, sync.checked = None, None, True
            else:
                again.append(i)
        for i in again:  # (what each sent, or not, it knows: Sync.sent)
            in_flight[i] = in_flight[i].redo(replicas, diloco.error_feedback())
            self.stats["syncs_redone"] += 1

    def _count_members(self, ids: list[str], cause: Exception | None) -> None:
        """Counts and logs the replicas that are gone from, or new in, the round."""
        stats = self.stats
        stats["rounds"] += 1
        if self._ids:
            run = self.membership.run_id
            for gone in sorted(set(self._ids) - set(ids)):
                stats["replicas_lost"] += 1
                _log.warning("cgx.DiLoCo: run %r: replica %s is gone (%s); %d replicas go on", run, gone,
                             "it left or died" if cause is None else f"{type(cause).__name__}: {cause}", len(ids))
            for new in sorted(set(ids) - set(self._ids)):
                stats["replicas_joined"] += 1
                _log.info("cgx.DiLoCo: run %r: replica %s joined; %d replicas", run, new, len(ids))
        self._ids = ids


def _holders_elsewhere(positions: list[dict[str, Any]]) -> bool:
    """Whether the run started but no replica of this round holds its state (and none
    is past step 0 without it: that is the error of a state lost while it was taken)."""
    return (any(p["run_started"] for p in positions) and not any(p["established"] for p in positions)
            and not any(p["position"] > 0 for p in positions))


def _reference(positions: list[dict[str, Any]]) -> int:
    """The rank whose state a forming round takes: of the established members, one with
    the most syncs applied, then the latest step; among those, one holding the state most
    of them hold (a replica that diverged is outvoted), then the lowest rank."""
    established = [r for r, p in enumerate(positions) if p["established"]]
    progress = {r: _progress(positions[r]) for r in established}
    furthest = [r for r in established if progress[r] == max(progress.values())]
    votes = collections.Counter(positions[r]["state"] for r in furthest)
    return min(furthest, key=lambda r: (-votes[positions[r]["state"]], r))


def _progress(position: dict[str, Any]) -> tuple[int, int]:
    return sum(position["syncs"]), position["position"]


class TookState(Exception):
    """This replica took another's state and step as the round formed: the step's syncs
    run again from the top (as that member has them)."""


def _refused(positions: list[dict[str, Any]]) -> dict[int, str]:
    """The ranks of a forming round whose DiLoCo is built otherwise than the run's (its
    members' with the lowest rank), each with the first difference. None are refused at
    the run's start: there every rank fails (DiLoCo._agree_on_construction)."""
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
