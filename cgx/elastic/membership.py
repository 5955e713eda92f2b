"""cgx.elastic.Membership: this replica's membership of an elastic run, round by round
(the protocol is in docs/diloco.md, "The elastic protocol"). It composes the run's terms
(terms.py), torch's rendezvous and the roll call (rounds.py), the admission
(admission.py) and the round formed beside training (next_round.py)."""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import time
import weakref
from typing import Any

import torch.distributed as dist

from cgx import _C
from cgx.backend import new_backend, shared_settings, with_process_settings
from cgx.config import Config, check_int, from_env
from cgx.elastic.admission import Admitted, GiveUpOnTheGone, Refused, admit
from cgx.elastic.next_round import NextRound
from cgx.elastic.rounds import MISSED_HEARTBEATS, Members, Rendezvous, Round, roll_call
from cgx.elastic.terms import Terms
from cgx.errors import MembershipError, PeerError

__all__ = ["Membership"]

_log = logging.getLogger("cgx.elastic")


class Membership:
    """This replica's membership of the elastic run `run_id`, round by round.

    Args:
        endpoint: the rendezvous endpoint, ``host:port`` (the c10d store backend: the
            replica on `host` serves it; see `is_host`).
        run_id: names the run: replicas of one run give the same.
        min_replicas, max_replicas: the sizes a round may have. A round forms once at
            least `min_replicas` are present; with fewer, :meth:`next_round` waits up to
            `join_timeout`, then raises :class:`cgx.MembershipError`.
        is_host: whether this replica serves the c10d store (default: torch decides from
            the endpoint's host name).
        rendezvous: the rendezvous backend, "c10d" or "etcd-v2".
        join_timeout: how long :meth:`next_round` waits for a round to form.
        last_call: once `min_replicas` are present, how long a round waits for more.
        heartbeat: a member whose heartbeats (one a `heartbeat`) stop for 3 of them is
            dropped from the rendezvous.
        roll_call: after a collective fails, how long the members wait for each other to
            answer a roll call (:meth:`next_round`). Those that answer go on among
            themselves at once; one silent past it is dropped (it died, or reached the
            failure later than that: then it joins again, taking the run's state).
        group_timeout: each round's backend's timeout (a collective with a dead or
            silent member raises within it).
        config: the rounds' backend settings (default: the ``CGX_*`` variables, read
            here, once).
        secret: the run's secret, which every replica must hold to join (read it from a
            file or an environment variable, never a command-line argument, where other
            users of the machine could read it). A replica without it, or with other
            terms (:meth:`set_terms`), is refused before it enters the rendezvous
            (:class:`cgx.MembershipError` or ValueError on it), at no cost to the
            members; one that skips that check is refused as the round forms, before
            the round's backend exists. It does not encrypt anything: the rounds'
            traffic (Gloo's TCP) and the rendezvous store are plain; tunnel them between
            sites (docs/diloco.md, "Who may join").
    """

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        *,
        min_replicas: int = 1,
        max_replicas: int = 64,
        is_host: bool | None = None,
        rendezvous: str = "c10d",
        join_timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        last_call: datetime.timedelta = datetime.timedelta(seconds=1),
        heartbeat: datetime.timedelta = datetime.timedelta(seconds=5),
        roll_call: datetime.timedelta = datetime.timedelta(seconds=2),
        group_timeout: datetime.timedelta = datetime.timedelta(minutes=5),
        config: Config | None = None,
        secret: bytes | None = None,
    ) -> None:
        what = "cgx.elastic.Membership"
        if secret is not None and not (isinstance(secret, bytes) and secret):
            raise TypeError(f"{what}: secret must be non-empty bytes or None, got {type(secret).__name__}")
        check_int(min_replicas, "min_replicas", what, low=1)
        check_int(max_replicas, "max_replicas", what, low=min_replicas)
        if not isinstance(roll_call, datetime.timedelta) or roll_call.total_seconds() <= 0:
            raise ValueError(f"{what}: roll_call must be a positive datetime.timedelta, got {roll_call!r}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"{what}: run_id must be a non-empty string, got {run_id!r}")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"{what}: config must be a cgx.Config, got {type(config).__name__}")
        # Read once, here: a bad CGX_* value fails on this replica alone, not in a round.
        config = from_env() if config is None else with_process_settings(config)
        options: dict[str, Any] = {
            "join_timeout": str(_whole_seconds(join_timeout, "join_timeout")),
            "last_call_timeout": str(_whole_seconds(last_call, "last_call")),
            "keep_alive_interval": str(_whole_seconds(heartbeat, "heartbeat")),
            "keep_alive_max_attempt": str(MISSED_HEARTBEATS),
        }
        if is_host is not None:
            options["is_host"] = bool(is_host)
        self.run_id = run_id
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        # How the others' logs and stats name this replica (a restarted one is a new replica).
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"
        self.group_timeout, self.join_timeout, self.roll_call = group_timeout, join_timeout, roll_call
        self.config = config
        self.round: Round | None = None
        self.rounds = 0  # rounds this replica was a member of
        self._members: Members | None = None
        self._next: NextRound | None = None  # the next round, forming beside this one (prepare_next_round)
        self._terms = Terms(run_id, secret, endpoint, rendezvous, group_timeout)
        self._terms.set("cgx", {"version": _cgx_version(), "settings": shared_settings(config)})
        self._last_store: dist.Store | None = None
        me = weakref.proxy(self)  # torch's handler holds the check: no cycle back to this object

        def forming_cancelled() -> bool:
            try:
                return me._forming_cancelled()
            except ReferenceError:
                return False
        self._rendezvous = Rendezvous(endpoint, run_id, rendezvous, min_replicas, max_replicas, options,
                                      group_timeout, join_timeout, cancelled=forming_cancelled)

    # ---- rounds

    def next_round(self, *, after_failure: bool = False) -> Round:
        """Leaves the current round (its backend is shut down) and returns the next one.
        Every member calls it: after a collective of the round failed
        (`after_failure=True`), or to admit joiners.

        Where :meth:`prepare_next_round` formed it beside the current round, it is that
        one (waited for where it is not formed yet). After a failure, the members first
        take a roll call on the round's store: those that answer within `roll_call` go
        on among themselves at once, in a round of a new backend, and torch's rendezvous
        is told that the silent ones are gone (so it does not wait for their heartbeats
        to stop). A member that answers too late, or a roll call that leaves fewer than
        `min_replicas` or cannot reach the store, goes to the rendezvous. There (and to
        admit joiners) it waits for the next round to form: the members still present,
        and those that were waiting to join. Raises :class:`cgx.MembershipError` where no
        round forms within `join_timeout` (fewer than `min_replicas` present), the run
        has ended (:meth:`end_run`) or the rendezvous cannot be reached, and
        :class:`cgx.PeerError` where a member was lost as the round's backend connected
        (ask again)."""
        if after_failure and self._next is not None:
            self._next.failed_at = time.monotonic()  # the forming round gives up on those it lost
        forming, self._next = self._next, None
        prepared = forming.take() if forming is not None else None
        self._leave_round()
        if prepared is not None:
            members, backend = prepared
            # Those that formed it without preparing (joiners) wait for this before
            # their first collective in it.
            try:
                self._rendezvous.reach_the_store(
                    lambda: dist.PrefixStore("cgx-moved/", members.store).set(str(members.rank), "1"))
            except MembershipError:
                backend.shutdown()
                raise
            return self._enter(members, backend)
        members = None
        if after_failure and self._members is not None:
            members = roll_call(self._rendezvous, self._members, self.roll_call, self.min_replicas)
        return self._enter(members or self._form())

    def prepare_next_round(self) -> None:
        """Starts forming the next round in the background (torch's rendezvous, the
        admission checks, the round's backend) while this one goes on, so that the
        members admit joiners without stopping for the rendezvous: every member calls it,
        trains on, and calls :meth:`next_round` together once :attr:`next_round_formed`
        (the joiners' :meth:`next_round` returns only then, however long the members
        train: as long as they are in torch's round, up to `join_timeout`). Meanwhile
        :meth:`joiners_waiting` says 0. A second call before :meth:`next_round` does
        nothing.

        torch's rendezvous may form that round without a member: it closes a round a last
        call after its second participant, and a member whose thread polls later (starved
        on a busy machine) waits for the round after, as one does that finds the round
        full (`max_replicas`). The others' round is then formed and that member's never
        is: it sees so in :attr:`left_out_of_next_round`, and the members, told (in the
        work, as for :attr:`next_round_formed`), call :meth:`form_next_round_again`."""
        if self._next is not None:
            return
        if self.round is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: only a member of a round prepares the next one")
        self._next = NextRound(lambda: self._form(beside=True), lambda m: self._backend_for(m, beside=True),
                               self.run_id)
        self._next.start()

    @property
    def left_out_of_next_round(self) -> bool:
        """Whether torch's rendezvous formed the round :meth:`prepare_next_round` forms
        without this member (it then waits for the round after): the members, told, call
        :meth:`form_next_round_again` with its rank. Reads the rendezvous state."""
        forming, members = self._next, self._members
        if forming is None or forming.done or members is None:
            return False
        # Not a round this member formed and left (form_next_round_again): it asks for the next.
        return self._rendezvous.formed_without(max(members.torch_round, forming.last_formed()))

    def form_next_round_again(self, ranks: list[int]) -> None:
        """Drops the round :meth:`prepare_next_round` formed (or forms) where it lacks a
        member of `ranks` (ranks of the current round, each left out of it:
        :attr:`left_out_of_next_round`), and forms the next round again beside this one,
        which then holds them (they wait for it in torch's rendezvous); where forming it
        failed, forms it again too. Every member calls it, with the same ranks, at the
        same point of the work; a member whose round holds them keeps it. Once the
        current round has failed, a round without them is kept: they may have died with
        it."""
        members = self._members
        if self._next is None or members is None:
            return
        if self._next.form_again({members.nodes[members.ranks[r]] for r in ranks}):
            _log.info("cgx.elastic: run %r: the next round formed without member(s) %s of this one, which wait "
                      "for the round after; it forms again", self.run_id, sorted(ranks))

    @property
    def next_round_preparing(self) -> bool:
        """Whether :meth:`prepare_next_round` was called and :meth:`next_round` has not
        taken its round yet."""
        return self._next is not None

    @property
    def next_round_formed(self) -> bool:
        """Whether the round :meth:`prepare_next_round` forms is ready (or its forming
        failed: then :meth:`next_round` forms one itself)."""
        return self._next is not None and self._next.done

    def joiners_waiting(self) -> int:
        """How many replicas wait to join (admitted by the members' next :meth:`next_round`).
        Raises :class:`cgx.PeerError` where torch's rendezvous no longer holds this
        replica in its round (it missed 3 heartbeats, or the round ended): its round may
        be going on without torch, so it leaves it, as after a failed collective."""
        if self._next is not None:  # the handler is the forming round's meanwhile
            return 0
        waiting = self._rendezvous.waiting()
        members = self._members
        if members is not None and self._rendezvous.ranks_in(members.torch_round) is None:
            # The round is torch's no more: the others may be forming the run's next one.
            raise PeerError(f"cgx.elastic: run {self.run_id!r}: torch's rendezvous no longer holds this replica in "
                            f"round {members.torch_round} (it missed {MISSED_HEARTBEATS} heartbeats, or the "
                            f"round ended); it asks the rendezvous again")
        return waiting

    # ---- the run's terms

    def set_terms(self, part: str, terms: Any) -> None:
        """What every replica of the run must hold alike under `part`, fixed for the run
        (JSON-able; values JSON does not know are compared as ``str()``). The members
        publish theirs; a replica joining the run compares its own with them before it
        asks for a round, and where they differ it is refused there (ValueError naming
        the first difference), at no cost to the members. cgx sets "cgx" (its version
        and the ``CGX_*`` settings that change bytes); :class:`cgx.DiLoCo` sets "diloco"
        (its schedule, bits and the model's parameters). A part a joiner holds that the
        members have not published yet is compared as the round forms instead."""
        self._terms.set(part, terms)
        if self.round is not None and self.round.rank == 0:
            self._terms.publish()

    @property
    def run_started(self) -> bool:
        """Whether a member said the run's training started (:meth:`mark_run_started`), on
        the rendezvous's store (c10d's; always False with another backend, which keeps
        no run-wide keys)."""
        return self._terms.started(self._rendezvous.reach_the_store)

    def mark_run_started(self) -> None:
        """Says, for the run's life, that its training started: a round of replicas that
        hold none of its state (all joiners, while the holders re-form) then waits for the
        holders instead of starting the run again (cgx.DiLoCo's recovery)."""
        self._terms.mark_started(self._rendezvous.reach_the_store)

    # ---- leaving and ending

    def close(self) -> None:
        """Leaves the run, which goes on, and says so: the round's backend is shut down
        (its connections close, so a member waiting on this replica gets a PeerError at
        once) and this replica leaves the rendezvous, so the others' next round forms
        without it at once. A round :meth:`prepare_next_round` is forming is given up
        (within a second of torch's rendezvous polls, or `group_timeout` where its
        backend is connecting). A second call does nothing. (torch's ``shutdown()``
        would close the rendezvous for every replica: that is :meth:`end_run`.)"""
        # The round's backend first: the others' collectives with this replica fail at
        # once, not at their timeout, while the next round's forming ends.
        self._leave_round()
        if self._next is not None:
            self._next.cancel()  # held meanwhile: the thread's waits ask it
            self._next = None
        if not self._rendezvous.closed and self.rounds > 0:
            self._rendezvous.leave()
        self._rendezvous.close()
        self._terms.close()

    def end_run(self) -> None:
        """Ends the run for every replica: the rendezvous is closed (no round forms any
        more; the others' next :meth:`next_round` raises, saying so, within a second of
        their asking). This replica stays until :meth:`close`; the replica that serves
        the c10d store should stay last, as the store goes with its Membership object
        (which may be closed before)."""
        if self._rendezvous.closed:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close()): call "
                                  f"end_run() before close()")
        self._rendezvous.end_run()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- forming a round

    def _forming_cancelled(self) -> bool:
        return self._next is not None and self._next.cancelled()

    def _form(self, beside: bool = False) -> Members:
        """The next round of torch's rendezvous, every newcomer admitted (`beside`: formed
        by prepare_next_round while this member's training goes on)."""
        if self.rounds == 0:
            try:
                self._terms.check_before_joining(self._rendezvous.reach_the_store)
            except (MembershipError, ValueError):
                self.close()
                raise
        while True:
            info = self._rendezvous.next()
            torch_round = self._rendezvous.round()
            store = self._rendezvous.round_store(info.store, torch_round)
            try:
                admitted = self._admit(store, torch_round, info.rank, info.world_size, beside)
            except Refused as refused:
                self.close()
                raise _refusal(self.run_id, refused) from None
            if admitted is not None:
                return Members(store, info.store, torch_round, 0, list(range(info.world_size)), info.rank,
                               tuple(admitted.beside), tuple(admitted.nodes))
            # A replica was refused, or went silent while the round formed: the others
            # form it again (a refused one leaves; a silent one did not ask).

    def _admit(self, store: dist.Store, torch_round: int, rank: int, size: int, beside: bool) -> Admitted | None:
        give_up = self._give_up(torch_round, list(range(size)), rank, beside)
        return admit(store, torch_round, rank, size, member=self.rounds > 0, beside=beside, terms=self._terms,
                     rendezvous=self._rendezvous, timeout=self.group_timeout, give_up=give_up)

    def _give_up(self, torch_round: int, ranks: list[int], me: int, beside: bool) -> GiveUpOnTheGone:
        forming = self._next if beside else None
        return GiveUpOnTheGone(self._rendezvous, torch_round, ranks, me, self.roll_call,
                               failed_at=None if forming is None else lambda: forming.failed_at,
                               cancelled=self._forming_cancelled)

    def _enter(self, members: Members, backend: _C.ProcessGroupCGX | None = None) -> Round:
        # On the store's host, the store serves the others as long as this object lives,
        # after close() too (the rendezvous's handler, which holds it, goes at close()).
        self._last_store = members.torch_store
        self._members = members
        rank, size = members.rank, len(members.ranks)
        store = members.store if members.epoch == 0 else dist.PrefixStore(f"cgx-call-{members.epoch}/", members.store)
        if backend is None:
            backend = self._backend_for(members)
            try:
                self._wait_for_the_move(members)
            except BaseException:
                backend.shutdown()
                raise
        self.round = Round(rank, size, backend, store)
        self.rounds += 1
        if rank == 0:
            self._terms.publish()
        return self.round

    def _wait_for_the_move(self, members: Members) -> None:
        """Where members formed this round beside their training, this replica (a joiner)
        waits until they have moved to it (next_round), which they do at a sync of theirs
        however far apart syncs are: as long as each is in torch's round, up to
        `join_timeout`. A member gone from it (it died, or left without moving) fails the
        wait with a PeerError: the replica forms the next round."""
        waiting_for = [r for r in members.beside if r != members.me]
        if not waiting_for:
            return
        moves = dist.PrefixStore("cgx-moved/", members.store)
        keys = [str(r) for r in waiting_for]
        give_up = self._give_up(members.torch_round, waiting_for, members.me, beside=False)
        started = time.monotonic()
        while not self._rendezvous.reach_the_store(lambda: moves.check(keys)):
            if time.monotonic() > started + self.join_timeout.total_seconds():
                raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the members of this replica's new round did "
                                      f"not move to it within join_timeout={self.join_timeout}")
            try:
                give_up(started, lambda: [])
            except dist.DistStoreError as e:
                raise PeerError(f"cgx.elastic: run {self.run_id!r}: while this replica waited for the members of its "
                                f"new round to move to it, {e}") from e
            time.sleep(0.02)

    def _leave_round(self) -> None:
        if self.round is not None:
            self.round.backend.shutdown()
            self.round = None

    def _backend_for(self, members: Members, beside: bool = False) -> _C.ProcessGroupCGX:
        """The round's cgx backend, made as a group's is, on the round's store (its
        settings' exchange gives up on a member gone as the admission's waits do; `beside`:
        formed by prepare_next_round). Gloo reports a member lost while it connects as a
        plain RuntimeError: here it is the PeerError it is, which recovery handles."""
        prefix = "cgx-round/" if members.epoch == 0 else f"cgx-call-{members.epoch}/cgx-round/"
        size = len(members.ranks)
        give_up = self._give_up(members.torch_round, members.ranks, members.me, beside)
        try:
            return new_backend(dist.PrefixStore(prefix, members.store), members.rank, size, self.group_timeout,
                               self.config, give_up)
        except dist.DistStoreError as e:  # a member gone before it showed its settings
            raise PeerError(f"cgx.elastic: run {self.run_id!r}: the round's backend could not connect its "
                            f"{size} members: {e}") from e
        except RuntimeError as e:
            if isinstance(e, dist.DistError):
                raise
            raise PeerError(f"cgx.elastic: run {self.run_id!r}: the round's backend could not connect its "
                            f"{size} members: {e}") from e


def _refusal(run_id: str, refused: Refused) -> Exception:
    """What a refused replica raises, naming why."""
    if refused.why == "secret":
        return MembershipError(f"cgx.elastic: run {run_id!r} refused this replica: it does not hold the run's secret "
                               f"(Membership(secret=...)), so it cannot join (nothing was sent to the run)")
    if refused.why == "terms":
        return ValueError(f"cgx.elastic: run {run_id!r} refused this replica: its terms (its cgx version, CGX_* "
                          f"settings or DiLoCo's) differ from the run's; every replica of a run must be built alike "
                          f"(nothing was sent to the run)")
    return MembershipError(f"cgx.elastic: run {run_id!r}: the replicas starting it do not hold the same secret (ranks "
                           f"{refused.differ} of this round differ from this one): every replica must be given the "
                           f"run's secret (or none)")


def _cgx_version() -> str:
    import cgx  # here: cgx imports this module as it starts

    return cgx.__version__


def _whole_seconds(value: datetime.timedelta, name: str) -> int:
    """The rendezvous takes its timeouts in whole seconds."""
    if not isinstance(value, datetime.timedelta) or value.total_seconds() < 1:
        raise ValueError(f"cgx.elastic.Membership: {name} must be a datetime.timedelta of at least 1 s, "
                         f"got {value!r}")
    return int(value.total_seconds())
