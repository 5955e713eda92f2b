"""Membership of an elastic run: rounds of replicas from torch.distributed.elastic.

The replicas of an elastic run (a rank each, or each host's lead rank) are started on
their own, each naming a rendezvous endpoint and a run id. Who is in the run comes from
torch's own dynamic rendezvous, the handler torchrun uses (the c10d store backend by
default, etcd where one runs): it forms rounds between ``min_replicas`` and
``max_replicas`` members, drops a member whose heartbeats stop, and keeps late arrivals
waiting until the members admit them with a new round. cgx adds one thing per round: a
compressing backend of its own (``ProcessGroupCGX``) on the round's store, which torch
already prefixes per round, so no key of an earlier round (or of a member that died in
it) can pair with this one's.

A round ends when a collective of it fails (a member died or lost its link: the failure
raises on every member still in the call) or when the members decide to admit joiners
(:meth:`Membership.joiners_waiting`); every member then calls :meth:`next_round`. After a
failure, a roll call on the round's store lets the members that answer go on at once,
and tells the rendezvous that the others are gone, rather than wait until it has missed
their heartbeats.

Example (one replica of a run; every replica runs the same)::

    membership = cgx.elastic.Membership("site-a.example:29400", "run-42", min_replicas=2)
    round_ = membership.next_round()            # waits for at least 2 replicas
    work = round_.backend.allreduce([tensor])   # a cgx backend of round_.size members
    ...                                         # where a collective failed:
    round_ = membership.next_round(after_failure=True)
    membership.close()                          # leaves (end_run() first ends the run for all)

This is the membership layer of elastic Streaming DiLoCo: ``cgx.DiLoCo(...,
membership=membership)`` syncs over the current round, re-forms it when a sync fails
(doing that sync again among the survivors) and admits joiners at a sync, giving them
the run's state from a live member (docs/diloco.md, "Elastic runs").
What happens when the rendezvous host itself dies: the c10d store lives in the process
that hosts it, so the run cannot form a new round (the current round's collectives go on,
the next :meth:`next_round` fails); etcd, which replicates its state, does not have this
weakness.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousError,
                                                  RendezvousGracefulExitError, RendezvousParameters,
                                                  RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from cgx import _C, rendezvous_access
from cgx.backend import GiveUp, gather, new_backend, shared_settings, with_process_settings
from cgx.config import Config, check_int, from_env
from cgx.errors import MembershipError, PeerError

__all__ = ["Membership", "Round"]

_log = logging.getLogger("cgx.elastic")
_MISSED_HEARTBEATS = 3  # torch's rendezvous drops a member that missed this many
# The participants of a torch rendezvous round see it complete up to about this far apart
# (each polls the state once a second, read through a cache of a second).
_ROUND_SKEW = 2.0


@dataclass(eq=False)
class Round:
    """One round of the run, as this member sees it."""

    rank: int  # this member's rank in the round (0..size-1; a member's rank may change between rounds)
    size: int  # the members of the round
    backend: _C.ProcessGroupCGX  # the round's cgx backend: collectives among its members
    store: dist.Store  # the round's store (on the rendezvous's store, prefixed per round)


@dataclass
class _Members:
    """Who the current round holds, in terms of the rendezvous round it came from: a
    rendezvous round (`epoch` 0), or what a roll call after a failure left of it."""

    store: dist.Store  # the rendezvous round's store for cgx's keys (_round_store)
    torch_store: dist.Store  # torch's own for the round (on the host, it serves the others)
    torch_round: int  # that round's number in torch's rendezvous
    epoch: int  # roll calls since the rendezvous round formed
    ranks: list[int]  # the members, by their rank in the rendezvous round
    rank: int  # this member's place in `ranks`
    beside: tuple[int, ...] = ()  # the ranks that formed it beside their training (prepare_next_round)
    nodes: tuple[str, ...] = ()  # each rank's node, as torch's rendezvous state names it


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
        self._secret = secret
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
            "keep_alive_max_attempt": str(_MISSED_HEARTBEATS),
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
        self._members: _Members | None = None
        self._prepared: concurrent.futures.Future | None = None  # the next round, forming (prepare_next_round)
        self._failed_meanwhile: float | None = None  # when the current round failed while the next one forms
        # The nodes of members that torch's rendezvous left out of the next round as it
        # formed (form_next_round_again): a next round without them is formed again.
        self._left_out: set[str] = set()
        self._forming = threading.Lock()  # the next round's result against form_next_round_again
        self._last_formed = -1  # the last round of torch's rendezvous this member's forming took part in
        self._endpoint, self._rendezvous_backend = endpoint, rendezvous
        self._terms: dict[str, Any] = {}
        self.set_terms("cgx", {"version": _cgx_version(), "settings": shared_settings(config)})
        self._terms_store: dist.Store | None = None  # the rendezvous's store, as the terms' (made when needed)
        self._last_store: dist.Store | None = None
        parameters = RendezvousParameters(backend=rendezvous, endpoint=endpoint, run_id=run_id,
                                          min_nodes=min_replicas, max_nodes=max_replicas, **options)
        try:
            self._handler = get_rendezvous_handler(parameters)
        except (RendezvousError, RuntimeError, ValueError) as e:
            raise MembershipError(f"{what}: cannot reach the rendezvous of run {run_id!r} at {endpoint}: {e}") from e

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
        round forms within `join_timeout` (fewer than `min_replicas` present) or the
        rendezvous cannot be reached, and :class:`cgx.PeerError` where a member was lost
        as the round's backend connected (ask again)."""
        if after_failure and self._prepared is not None:
            self._failed_meanwhile = time.monotonic()  # the forming round gives up on those it lost
        prepared = self._take_prepared()
        self._leave_round()
        if prepared is not None:
            members, backend = prepared
            # Those that formed it without preparing (joiners) wait for this before
            # their first collective in it.
            try:
                self._reach_the_store(lambda: dist.PrefixStore("cgx-moved/", members.store).set(str(members.rank), "1"))
            except MembershipError:
                backend.shutdown()
                raise
            return self._enter(members, backend)
        members = self._roll_call() if after_failure and self._members is not None else None
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
        if self._prepared is not None:
            return
        if self.round is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: only a member of a round prepares the next one")
        self._failed_meanwhile = None
        self._left_out = set()
        self._start_forming()

    def _start_forming(self) -> None:
        prepared: concurrent.futures.Future = concurrent.futures.Future()

        def form() -> None:
            try:
                while True:
                    members = self._form(beside=True)
                    self._last_formed = members.torch_round
                    try:
                        backend = self._backend_for(members, beside=True)
                    except PeerError:
                        if self._lacks_the_left_out(members):  # the others left it as this one connected
                            continue
                        raise
                    with self._forming:
                        if not self._lacks_the_left_out(members):
                            prepared.set_result((members, backend))
                            return
                    backend.shutdown()
            except BaseException as e:  # noqa: BLE001  (next_round() raises it, or forms the round itself)
                prepared.set_exception(e)
        self._prepared = prepared
        threading.Thread(target=form, name="cgx-next-round", daemon=True).start()

    @property
    def left_out_of_next_round(self) -> bool:
        """Whether torch's rendezvous formed the round :meth:`prepare_next_round` forms
        without this member (it then waits for the round after): the members, told, call
        :meth:`form_next_round_again` with its rank. Reads the rendezvous state."""
        prepared, members = self._prepared, self._members
        if prepared is None or prepared.done() or members is None:
            return False
        # Not a round this member formed and left (form_next_round_again): it asks for the next.
        after = max(members.torch_round, self._last_formed)
        return self._read_the_rendezvous(lambda: rendezvous_access.formed_without(self._handler, after)) is not None

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
        with self._forming:
            self._left_out |= {members.nodes[members.ranks[r]] for r in ranks}
            prepared = self._prepared
            if prepared is None or not prepared.done():
                return  # the thread forming it drops a round without them as it forms it
            failed = prepared.exception()
            if isinstance(failed, MembershipError):
                return  # next_round raises it
            # A forming that failed (the others left the round as this one connected)
            # forms again too, with them.
            backend = None if failed is not None else prepared.result()[1]
            if failed is None and not self._lacks_the_left_out(prepared.result()[0]):
                return
        _log.info("cgx.elastic: run %r: the next round formed without member(s) %s of this one, which wait for the "
                  "round after; it forms again", self.run_id, sorted(ranks))
        if backend is not None:
            backend.shutdown()
        self._start_forming()

    def _lacks_the_left_out(self, members: _Members) -> bool:
        return self._failed_meanwhile is None and not self._left_out <= set(members.nodes)

    @property
    def next_round_preparing(self) -> bool:
        """Whether :meth:`prepare_next_round` was called and :meth:`next_round` has not
        taken its round yet."""
        return self._prepared is not None

    @property
    def next_round_formed(self) -> bool:
        """Whether the round :meth:`prepare_next_round` forms is ready (or its forming
        failed: then :meth:`next_round` forms one itself)."""
        return self._prepared is not None and self._prepared.done()

    def _take_prepared(self) -> tuple[_Members, _C.ProcessGroupCGX] | None:
        """The round prepare_next_round() formed (waited for), or None where none was
        prepared or forming it failed (logged: next_round() forms one itself)."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        try:
            return prepared.result()
        except MembershipError:
            raise
        except (dist.DistError, RuntimeError) as e:
            _log.warning("cgx.elastic: run %r: forming the next round beside this one failed (%s: %s); it is formed "
                         "again", self.run_id, type(e).__name__, e)
            return None

    def _form(self, beside: bool = False) -> _Members:
        """The next round of torch's rendezvous, every newcomer admitted (`beside`: formed
        by prepare_next_round while this member's training goes on)."""
        if self.rounds == 0:
            self._check_terms()
        while True:
            info = self._rendezvous()
            torch_round = rendezvous_access.round_of(self._handler)
            store = self._round_store(info.store, torch_round)
            admitted = self._admit(store, torch_round, info.rank, info.world_size, beside)
            if admitted is not None:
                formed_beside, nodes = admitted
                return _Members(store, info.store, torch_round, 0, list(range(info.world_size)), info.rank,
                                tuple(formed_beside), tuple(nodes))
            # A replica was refused, or went silent while the round formed: the others
            # form it again (a refused one leaves; a silent one did not ask).

    def _enter(self, members: _Members, backend: _C.ProcessGroupCGX | None = None) -> Round:
        # On the store's host, the store serves the others as long as this object lives,
        # after close() too (the handler, which holds it, goes at close()).
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
            self._publish_terms()
        return self.round

    def _wait_for_the_move(self, members: _Members) -> None:
        """Where members formed this round beside their training, this replica (a joiner)
        waits until they have moved to it (next_round), which they do at a sync of theirs
        however far apart syncs are: as long as each is in torch's round, up to
        `join_timeout`. A member gone from it (it died, or left without moving) fails the
        wait with a PeerError: the replica forms the next round."""
        me = members.ranks[members.rank]
        waiting_for = [r for r in members.beside if r != me]
        if not waiting_for:
            return
        moves = dist.PrefixStore("cgx-moved/", members.store)
        keys = [str(r) for r in waiting_for]
        give_up = self._give_up_on_the_gone(members.torch_round, waiting_for, me, beside=False)
        started = time.monotonic()
        while not self._reach_the_store(lambda: moves.check(keys)):
            if time.monotonic() > started + self.join_timeout.total_seconds():
                raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the members of this replica's new round did "
                                      f"not move to it within join_timeout={self.join_timeout}")
            try:
                give_up(started, lambda: [])
            except dist.DistStoreError as e:
                raise PeerError(f"cgx.elastic: run {self.run_id!r}: while this replica waited for the members of its "
                                f"new round to move to it, {e}") from e
            time.sleep(0.02)

    def _reach_the_store(self, read: Callable[[], Any]) -> Any:
        """`read` of the rendezvous's store, where its failing means the store's host is
        gone (a TCPStore client does not connect again): the run cannot form rounds any
        more (MembershipError, not a PeerError to form again after)."""
        try:
            return read()
        except dist.DistError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the rendezvous store at {self._endpoint} cannot "
                                  f"be reached (its host is gone?): {type(e).__name__}: {e}") from e

    def _read_the_rendezvous(self, read: Callable[[], Any]) -> Any:
        """`read` of torch's rendezvous state, where its failing means no round can form
        any more (MembershipError)."""
        try:
            return read()
        except RendezvousError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the rendezvous cannot be read: {e}") from e

    def _roll_call(self) -> _Members | None:
        """The members of the failed round that answer a roll call on its store within
        `roll_call`: every member waits for the others' answers until all have answered
        or its own `roll_call` has passed since it answered; the first whose wait ends
        writes the verdict (compare-and-set: one verdict for all, whatever each saw), and
        those in it tell torch's rendezvous that the silent ones are gone. None where this
        replica is no longer in torch's round, is not in the verdict (it answered late:
        it joins again), where fewer than `min_replicas` answered, or where the store
        cannot be reached: then the rendezvous decides."""
        members = self._members
        me = members.ranks[members.rank]
        store = dist.PrefixStore(f"cgx-roll-call/{members.epoch}/", members.store)
        try:
            # Only a member of torch's round goes on in it: one that torch dropped (its
            # heartbeats missed) or whose round torch has ended asks the rendezvous.
            if not rendezvous_access.in_round(self._handler, members.torch_round):
                return None
            store.set(f"here/{me}", "1")
            answered = store.add("answered", 1)
            deadline = time.monotonic() + self.roll_call.total_seconds()
            while answered < len(members.ranks) and time.monotonic() < deadline:
                time.sleep(0.01)
                answered = store.add("answered", 0)
            here = [r for r in members.ranks if r == me or store.check([f"here/{r}"])]
            mine = json.dumps(here)
            verdict = store.compare_set("verdict", "", mine).decode()
        except (RendezvousError, dist.DistError, RuntimeError) as e:
            _log.info("cgx.elastic: run %r: the roll call after a failure could not use the round's store (%s: %s); "
                      "the rendezvous forms the next round", self.run_id, type(e).__name__, e)
            return None
        present = json.loads(verdict)
        gone = [r for r in members.ranks if r not in present]
        if gone and me in present:  # each (where the verdict's writer dies before it does)
            self._expire(members, gone)
        if me not in present:
            _log.warning("cgx.elastic: run %r: this replica answered the roll call after a failure too late; it joins "
                         "the run again", self.run_id)
            return None
        if len(present) < self.min_replicas:
            return None
        return _Members(members.store, members.torch_store, members.torch_round, members.epoch + 1, present,
                        present.index(me), nodes=members.nodes)

    def _expire(self, members: _Members, gone: list[int]) -> None:
        """Tells torch's rendezvous that the members `gone` (ranks of its round) are:
        its next round then forms without waiting for their heartbeats to stop."""
        try:
            rendezvous_access.expire(self._handler, members.torch_round, members.ranks[members.rank], gone,
                                     time.monotonic() + self.group_timeout.total_seconds())
        except (RendezvousError, dist.DistError, RuntimeError) as e:
            _log.info("cgx.elastic: run %r: could not tell the rendezvous that ranks %s are gone (%s: %s); it drops "
                      "them after their missed heartbeats", self.run_id, gone, type(e).__name__, e)

    def set_terms(self, part: str, terms: Any) -> None:
        """What every replica of the run must hold alike under `part`, fixed for the run
        (JSON-able; values JSON does not know are compared as ``str()``). The members
        publish theirs; a replica joining the run compares its own with them before it
        asks for a round, and where they differ it is refused there (ValueError naming
        the first difference), at no cost to the members. cgx sets "cgx" (its version
        and the ``CGX_*`` settings that change bytes); :class:`cgx.DiLoCo` sets "diloco"
        (its schedule, bits and the model's parameters). Call before the first
        :meth:`next_round`."""
        self._terms[part] = json.loads(json.dumps(terms, sort_keys=True, default=str))
        if self.round is not None and self.round.rank == 0:
            self._publish_terms()

    def _check_terms(self) -> None:
        """Admission before membership: a replica not yet in the run reads the terms its
        members published and refuses itself where it does not hold the run's secret (the
        terms' tag) or its terms differ, before it enters the rendezvous, so the members
        spend nothing on it: no round, no store wait. Where none are published the run has
        not started, and this replica's first round starts it."""
        store = self._store_of_terms()
        if store is None or not self._reach_the_store(lambda: store.check([self._terms_key])):
            return
        published = json.loads(self._reach_the_store(lambda: store.get(self._terms_key)))
        run_id = self.run_id
        if not hmac.compare_digest(published["tag"], self._tag(published["terms"])):
            self.close()
            holds = "the run's secret" if self._secret is not None else "a secret (Membership(secret=...))"
            raise MembershipError(f"cgx.elastic: run {run_id!r} refused this replica before it joined: it does not "
                                  f"hold {holds}, so it cannot join (nothing was sent to the run)")
        difference = _first_difference(json.loads(published["terms"]), self._terms)
        if difference:
            self.close()
            raise ValueError(f"cgx.elastic: run {run_id!r} refused this replica before it joined: {difference}; "
                             f"every replica of a run must be built alike (nothing was sent to the run)")

    def _publish_terms(self) -> None:
        text = json.dumps(self._terms, sort_keys=True)
        store = self._store_of_terms()
        if store is not None:
            store.set(self._terms_key, json.dumps({"terms": text, "tag": self._tag(text)}))

    @property
    def _terms_key(self) -> str:
        return f"cgx-terms/{self.run_id}"

    def _store_of_terms(self) -> dist.Store | None:
        """A client of the rendezvous's own store (the c10d backend's), which outlives
        the rounds. None for another rendezvous backend: there a joiner's terms are
        checked as a round forms (costing the members that round)."""
        if self._terms_store is None and self._rendezvous_backend == "c10d":
            host, port = parse_rendezvous_endpoint(self._endpoint, default_port=29400)
            try:
                self._terms_store = dist.TCPStore(host, port, is_master=False, timeout=self.group_timeout)
            except (RuntimeError, ValueError) as e:
                raise MembershipError(f"cgx.elastic: cannot reach the rendezvous of run {self.run_id!r} at "
                                      f"{self._endpoint}: {e}") from e
        return self._terms_store

    def _tag(self, terms: str) -> str:
        """The terms' tag: only a holder of the run's secret makes it ("" without a secret)."""
        if self._secret is None:
            return ""
        return hmac.new(self._secret, f"cgx-elastic-terms/{self.run_id}/{terms}".encode(), hashlib.sha256).hexdigest()

    def _rendezvous(self):
        if self._handler is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close())")
        try:
            with _unshared_bootstrap_store():
                return self._handler.next_rendezvous()
        except (RendezvousClosedError, RendezvousGracefulExitError) as e:  # (the latter: while waiting for a place)
            raise MembershipError(f"cgx.elastic: run {self.run_id!r} has ended: a replica called end_run() "
                                  f"(the rendezvous is closed)") from e
        except RendezvousTimeoutError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: no round formed with this replica within "
                                  f"join_timeout={self.join_timeout}: fewer than min_replicas={self.min_replicas} "
                                  f"replicas came, or the rounds had no place for it (max_replicas="
                                  f"{self.max_replicas}) ({type(e).__name__} from torch's "
                                  f"rendezvous{': ' + str(e) if str(e) else ''})") from e
        except RendezvousError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: no round formed: "
                                  f"{type(e).__name__}: {e}") from e

    def _admit(self, round_store: dist.Store, torch_round: int, rank: int, size: int,
               beside: bool) -> tuple[list[int], list[str]] | None:
        """The run's secret and terms, checked as the round forms, before its backend
        exists (so before a byte of a collective moves): the check of a replica that did
        not meet the published terms first (it came as the run started, or by another
        rendezvous backend). Each member adds a random nonce; the round's challenge is the
        hash of all of them (no member chooses it); each proves it holds the secret with
        an HMAC of the challenge and its rank, and shows a digest of its terms. Every
        member then gives its verdict: the members of earlier rounds refuse a newcomer
        whose proof fails or whose terms differ (MembershipError or ValueError on it; it
        leaves, and the others form the round again without it: None). A replica gone
        meanwhile is left behind (None; see :meth:`_give_up_on_the_gone`). In a round of
        newcomers only (the run's start), a failed proof fails every member.

        Returns the ranks that form the round beside their training (`beside` on each)
        and every rank's node, or None where it forms again."""
        store = dist.PrefixStore("cgx-admission/", round_store)
        give_up = self._give_up_on_the_gone(torch_round, list(range(size)), rank, beside)

        def gathered(key: str, value: str) -> list[str]:
            return gather(store, key, rank, size, value, self.group_timeout, give_up)
        try:
            nonces = gathered("nonce", secrets.token_hex(16))
            challenge = hashlib.sha256("/".join(nonces).encode()).hexdigest()
            claim = {"proof": self._proof(challenge, rank), "member": self.rounds > 0,
                     "terms": self._terms_digest(), "beside": beside, "node": rendezvous_access.node_of(self._handler)}
            claims = [json.loads(c) for c in gathered("claim", json.dumps(claim))]
            valid = [hmac.compare_digest(c["proof"], self._proof(challenge, r)) for r, c in enumerate(claims)]
            starting = not any(c["member"] for c in claims)
            nodes = [c["node"] for c in claims]
            verdict: dict[str, Any] = {"refused": {}}
            if self.rounds > 0:  # an established member judges the newcomers
                for r, c in enumerate(claims):
                    if not valid[r]:
                        verdict["refused"][r] = "secret"
                    elif not c["member"] and c["terms"] != self._terms_digest():
                        verdict["refused"][r] = "terms"
            verdicts = [json.loads(v) for v in gathered("verdict", json.dumps(verdict))]
        except MembershipError:
            raise
        except dist.DistError:
            return None
        if starting:
            self._starting_together(store, valid, rank, size)
            return [], nodes
        refused = {int(r): why for v in verdicts for r, why in v["refused"].items()}
        if rank in refused:
            self.close()
            if refused[rank] == "secret":
                raise MembershipError(f"cgx.elastic: run {self.run_id!r} refused this replica: it does not hold the "
                                      f"run's secret (Membership(secret=...)), so it cannot join (nothing was sent "
                                      f"to the run)")
            raise ValueError(f"cgx.elastic: run {self.run_id!r} refused this replica: its terms (its cgx version, "
                             f"CGX_* settings or DiLoCo's) differ from the run's; every replica of a run must be "
                             f"built alike (nothing was sent to the run)")
        if refused:
            return None
        return [r for r, c in enumerate(claims) if c["beside"]], nodes

    def _give_up_on_the_gone(self, torch_round: int, ranks: list[int], me: int, beside: bool) -> GiveUp:
        """How a wait of a forming round (the members `ranks` of rendezvous round
        `torch_round`; this member is rank `me` of it) gives up on a member that will not
        write (DistStoreError: the round forms again without it; MembershipError where
        the rendezvous cannot be read), sooner than
        `group_timeout`: once torch's rendezvous no longer holds it in the round (it left,
        or missed its heartbeats; read once a second); and, where this member forms the
        round beside a round that failed meanwhile (`beside`), once it has been silent for
        `roll_call` after that failure and after the wait's start, plus the time the
        round's participants may see it complete apart: it most likely died with the
        failed round, and is dropped from torch's rendezvous, as a roll call drops the
        silent. (A live member slower than that is dropped too: it joins again.)"""
        next_check = time.monotonic() + 1.0

        def give_up(started: float, missing: Callable[[], list[int]]) -> None:
            nonlocal next_check
            now = time.monotonic()
            failed_at = self._failed_meanwhile
            if beside and failed_at is not None and \
                    now > max(failed_at, started) + self.roll_call.total_seconds() + _ROUND_SKEW:
                silent = [ranks[i] for i in missing()]
                try:
                    rendezvous_access.expire(self._handler, torch_round, me, silent,
                                             now + self.group_timeout.total_seconds())
                except (RendezvousError, RuntimeError) as e:
                    _log.info("cgx.elastic: run %r: could not tell the rendezvous that ranks %s are gone (%s: %s)",
                              self.run_id, silent, type(e).__name__, e)
                raise dist.DistStoreError(f"ranks {silent} of the forming round are silent after a failure")
            if now >= next_check:
                next_check = now + 1.0
                present = self._read_the_rendezvous(lambda: rendezvous_access.ranks_in_round(self._handler,
                                                                                              torch_round))
                if present is None:
                    raise dist.DistStoreError(f"torch's rendezvous dropped this replica from round {torch_round}")
                gone = sorted(set(ranks) - present)
                if gone:
                    raise dist.DistStoreError(f"ranks {gone} of it left torch's rendezvous")
        return give_up

    def _starting_together(self, store: dist.Store, valid: list[bool], rank: int, size: int) -> None:
        """The run's start (no member of an earlier round): any failed proof fails every
        member. (Differing terms fail them too, in the backend's and DiLoCo's agreement.)"""
        if all(valid):
            return
        # Each waits until all have read the proofs, so that the one serving the store does
        # not take it away from a slower one. That one may leave while this one's wait is
        # in flight: all have read the proofs by then (this one too), so a lost store
        # changes nothing of the verdict.
        ranks = range(size)
        store.set(f"failed/{rank}", "1")
        try:
            store.wait([f"failed/{r}" for r in ranks], self.group_timeout)
        except dist.DistError:
            pass
        self.close()
        raise MembershipError(
            f"cgx.elastic: run {self.run_id!r}: the replicas starting it do not hold the same secret "
            f"(ranks {[r for r in ranks if not valid[r]]} of this round differ from this one): every replica "
            f"must be given the run's secret (or none)")

    def _terms_digest(self) -> str:
        return hashlib.sha256(json.dumps(self._terms, sort_keys=True).encode()).hexdigest()

    def _proof(self, challenge: str, rank: int) -> str:
        """This replica's proof for `rank` of a round with `challenge` ("" without a secret)."""
        if self._secret is None:
            return ""
        message = f"cgx-elastic/{self.run_id}/{challenge}/{rank}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def joiners_waiting(self) -> int:
        """How many replicas wait to join (admitted by the members' next :meth:`next_round`).
        Raises :class:`cgx.PeerError` where torch's rendezvous no longer holds this
        replica in its round (it missed 3 heartbeats, or the round ended): its round may
        be going on without torch, so it leaves it, as after a failed collective."""
        if self._handler is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close())")
        if self._prepared is not None:  # the handler is the forming round's meanwhile
            return 0
        waiting = self._read_the_rendezvous(self._handler.num_nodes_waiting)
        dropped = self._members is not None and not self._read_the_rendezvous(
            lambda: rendezvous_access.in_round(self._handler, self._members.torch_round))
        if dropped:  # the round is torch's no more: the others may be forming the run's next one
            raise PeerError(f"cgx.elastic: run {self.run_id!r}: torch's rendezvous no longer holds this replica in "
                            f"round {self._members.torch_round} (it missed {_MISSED_HEARTBEATS} heartbeats, or the "
                            f"round ended); it asks the rendezvous again")
        return waiting

    def close(self) -> None:
        """Leaves the run, which goes on, and says so: the round's backend is shut down
        (its connections close, so a member waiting on this replica gets a PeerError at
        once) and this replica leaves the rendezvous, so the others' next round forms
        without it at once. Where :meth:`prepare_next_round` is forming the next round,
        it waits for that to end first (a member left out of it waits in torch's wait
        list until the others, gone on without it, form the round after: seconds). A
        second call does nothing. (torch's ``shutdown()`` would close the rendezvous for
        every replica: that is :meth:`end_run`.)"""
        # The round's backend first: the others' collectives with this replica fail at
        # once, not at their timeout, while the next round's forming ends (a member left
        # out of it waits in torch's wait list until the others form the round after).
        self._leave_round()
        try:
            prepared = self._take_prepared()  # the handler is its meanwhile
        except MembershipError:
            prepared = None
        if prepared is not None:
            prepared[1].shutdown()
        if self._handler is not None and self.rounds > 0:
            self._leave_rendezvous()
        self._handler = None  # its heartbeat timer holds it weakly: no beat after this
        self._terms_store = None

    def _leave_rendezvous(self) -> None:
        """torch's handler leaves a round only as the first step of joining the next (its
        exit operation, which takes this node out of the round's participants): that step
        alone. Without it the others' next round waits until this node's heartbeats are
        missed 3 times. A rendezvous that cannot be reached any more is left as it is."""
        try:
            rendezvous_access.leave(self._handler, time.monotonic() + self.group_timeout.total_seconds())
        except (RendezvousError, dist.DistError, RuntimeError) as e:
            _log.info("cgx.elastic: run %r: could not tell the rendezvous that this replica left (%s: %s); the "
                      "others drop it after its missed heartbeats", self.run_id, type(e).__name__, e)

    def end_run(self) -> None:
        """Ends the run for every replica: the rendezvous is closed (no round forms any
        more; the others' next :meth:`next_round` raises, saying so). This replica stays
        until :meth:`close`; the replica that serves the c10d store should stay last, as
        the store goes with its Membership object (which may be closed before)."""
        if self._handler is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close()): call "
                                  f"end_run() before close()")
        self._handler.set_closed()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _leave_round(self) -> None:
        if self.round is not None:
            self.round.backend.shutdown()
            self.round = None

    def _round_store(self, torch_store: dist.Store, torch_round: int) -> dist.Store:
        """The round's store for cgx's keys (the admission, the roll calls, the backends,
        Round.store): on a client of its own where the rendezvous is c10d's, because
        torch's heartbeats go through the handler's client, which a store wait holds for
        as long as it waits: a wait there (a member silent while a backend connects, up
        to `group_timeout`) would stop this member's heartbeats, and torch would drop it
        from the rendezvous while its round went on."""
        if self._rendezvous_backend != "c10d":
            return torch_store
        host, port = parse_rendezvous_endpoint(self._endpoint, default_port=29400)
        client = dist.TCPStore(host, port, is_master=False, timeout=self.group_timeout)
        return dist.PrefixStore(f"cgx-round-store/{self.run_id}/{torch_round}/", client)

    def _backend_for(self, members: _Members, beside: bool = False) -> _C.ProcessGroupCGX:
        """The round's cgx backend, made as a group's is, on the round's store (its
        settings' exchange gives up on a member gone as the admission's waits do; `beside`:
        formed by prepare_next_round). Gloo reports a member lost while it connects as a
        plain RuntimeError: here it is the PeerError it is, which recovery handles."""
        prefix = "cgx-round/" if members.epoch == 0 else f"cgx-call-{members.epoch}/cgx-round/"
        size = len(members.ranks)
        give_up = self._give_up_on_the_gone(members.torch_round, members.ranks, members.ranks[members.rank], beside)
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


def _cgx_version() -> str:
    import cgx  # here: cgx imports this module as it starts

    return cgx.__version__


def _first_difference(run: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """The first entry where this replica's terms differ from the run's, said for a user;
    None where they agree."""
    for part in sorted(set(run) ^ set(mine)):
        if part in run:
            return (f"the run holds {part!r} terms and this replica none (cgx.DiLoCo sets its own: build it "
                    f"before the membership's first next_round())")
        return f"this replica holds {part!r} terms and the run none"
    for part in sorted(set(run) & set(mine)):
        theirs, ours = run[part], mine[part]
        names = sorted(set(theirs) | set(ours)) if isinstance(theirs, dict) and isinstance(ours, dict) else [None]
        for name in names:
            a, b = (theirs, ours) if name is None else (theirs.get(name), ours.get(name))
            if a != b:
                what = part if name is None else f"{part} {name}"
                if isinstance(a, dict) and isinstance(b, dict):
                    key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
                    what, a, b = f"{what} {key}", a.get(key), b.get(key)
                if isinstance(a, list) and isinstance(b, list):
                    return (f"its {what} differ from the run's: it has {[x for x in b if x not in a][:2] or 'no more'},"
                            f" the run {[x for x in a if x not in b][:2] or 'no more'}")
                return f"its {what} is {b!r} where the run's is {a!r}"
    return None


def _whole_seconds(value: datetime.timedelta, name: str) -> int:
    """The rendezvous takes its timeouts in whole seconds."""
    if not isinstance(value, datetime.timedelta) or value.total_seconds() < 1:
        raise ValueError(f"cgx.elastic.Membership: {name} must be a datetime.timedelta of at least 1 s, "
                         f"got {value!r}")
    return int(value.total_seconds())


@contextlib.contextmanager
def _unshared_bootstrap_store():
    """torch's dynamic rendezvous shares a bootstrap TCPStore by default, and its members
    publish that store's address only in their first round, so a replica joining a later
    round waits for an address nobody writes (until the store's timeout). cgx needs only
    the round's store: it opts out as torch documents, for its own rendezvous calls."""
    variable = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    previous = os.environ.get(variable)
    os.environ[variable] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[variable]
        else:
            os.environ[variable] = previous
