"""The rounds of an elastic run: torch's dynamic rendezvous as cgx uses it, and the roll
call that lets the members of a failed round go on among themselves at once.

:class:`Rendezvous` is the one holder of torch's handler: every call to it (forming a
round, leaving one, reading who is in one, dropping the gone) goes through it, each
failure turned into the error that says what it means for the run."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
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
from cgx.errors import MembershipError

_log = logging.getLogger("cgx.elastic")
MISSED_HEARTBEATS = 3  # torch's rendezvous drops a member that missed this many


@dataclass(eq=False)
class Round:
    """One round of the run, as this member sees it."""

    rank: int  # this member's rank in the round (0..size-1; a member's rank may change between rounds)
    size: int  # the members of the round
    backend: _C.ProcessGroupCGX  # the round's cgx backend: collectives among its members
    store: dist.Store  # the round's store (on the rendezvous's store, prefixed per round)


@dataclass
class Members:
    """Who the current round holds, in terms of the rendezvous round it came from: a
    rendezvous round (`epoch` 0), or what a roll call after a failure left of it."""

    store: dist.Store  # the rendezvous round's store for cgx's keys (Rendezvous.round_store)
    torch_store: dist.Store  # torch's own for the round (on the host, it serves the others)
    torch_round: int  # that round's number in torch's rendezvous
    epoch: int  # roll calls since the rendezvous round formed
    ranks: list[int]  # the members, by their rank in the rendezvous round
    rank: int  # this member's place in `ranks`
    beside: tuple[int, ...] = ()  # the ranks that formed it beside their training (prepare_next_round)
    nodes: tuple[str, ...] = ()  # each rank's node, as torch's rendezvous state names it

    @property
    def me(self) -> int:
        """This member's rank in the rendezvous round."""
        return self.ranks[self.rank]


class Rendezvous:
    """This replica's handle on torch's dynamic rendezvous of run `run_id` (the options
    are Membership's; see there). Its operations give up as at their deadline where
    `cancelled()` (asked on the thread that runs them) says so."""

    def __init__(self, endpoint: str, run_id: str, backend: str, min_replicas: int, max_replicas: int,
                 options: dict[str, Any], group_timeout: datetime.timedelta,
                 join_timeout: datetime.timedelta, cancelled: Callable[[], bool]) -> None:
        self.run_id, self.endpoint, self.backend = run_id, endpoint, backend
        self._group_timeout, self._join_timeout = group_timeout, join_timeout
        self._min_replicas, self._max_replicas = min_replicas, max_replicas
        parameters = RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id,
                                          min_nodes=min_replicas, max_nodes=max_replicas, **options)
        try:
            self._handler = get_rendezvous_handler(parameters)
        except (RendezvousError, RuntimeError, ValueError) as e:
            raise MembershipError(f"cgx.elastic.Membership: cannot reach the rendezvous of run {run_id!r} at "
                                  f"{endpoint}: {e}") from e
        rendezvous_access.make_cancellable(self._handler, cancelled)

    @property
    def closed(self) -> bool:
        """Whether this replica left (close()): no call reaches torch's handler any more."""
        return self._handler is None

    def next(self):
        """torch's next round with this replica (RendezvousInfo), waited for up to
        join_timeout. MembershipError where the run has ended, no round formed in time, or
        the rendezvous cannot be used."""
        handler = self._live_handler()
        try:
            with _unshared_bootstrap_store():
                return handler.next_rendezvous()
        except (RendezvousClosedError, RendezvousGracefulExitError) as e:  # (the latter: while waiting for a place)
            raise MembershipError(f"cgx.elastic: run {self.run_id!r} has ended: a replica called end_run() "
                                  f"(the rendezvous is closed)") from e
        except RendezvousTimeoutError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: no round formed with this replica within "
                                  f"join_timeout={self._join_timeout}: fewer than min_replicas={self._min_replicas} "
                                  f"replicas came, or the rounds had no place for it (max_replicas="
                                  f"{self._max_replicas}) ({type(e).__name__} from torch's "
                                  f"rendezvous{': ' + str(e) if str(e) else ''})") from e
        except RendezvousError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: no round formed: "
                                  f"{type(e).__name__}: {e}") from e

    def round(self) -> int:
        """The number of the round torch's rendezvous formed last with this replica."""
        return rendezvous_access.round_of(self._live_handler())

    def node(self) -> str:
        return rendezvous_access.node_of(self._live_handler())

    def read(self, read: Callable[[Any], Any]) -> Any:
        """`read(handler)` of torch's rendezvous state, where its failing means no round
        can form any more (MembershipError)."""
        try:
            return read(self._live_handler())
        except RendezvousError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the rendezvous cannot be read: {e}") from e

    def waiting(self) -> int:
        """The replicas waiting to join."""
        return self.read(lambda handler: handler.num_nodes_waiting())

    def ranks_in(self, torch_round: int) -> set[int] | None:
        """The ranks of `torch_round` still in it; None where this replica is not."""
        return self.read(lambda handler: rendezvous_access.ranks_in_round(handler, torch_round))

    def formed_without(self, after: int) -> bool:
        """Whether a round after `after` formed without this replica."""
        return self.read(lambda handler: rendezvous_access.formed_without(handler, after)) is not None

    def reach_the_store(self, read: Callable[[], Any]) -> Any:
        """`read` of the rendezvous's store, where its failing means the store's host is
        gone (a TCPStore client does not connect again): the run cannot form rounds any
        more (MembershipError, not a PeerError to form again after)."""
        try:
            return read()
        except dist.DistError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the rendezvous store at {self.endpoint} "
                                  f"cannot be reached (its host is gone?): {type(e).__name__}: {e}") from e

    def round_store(self, torch_store: dist.Store, torch_round: int) -> dist.Store:
        """The round's store for cgx's keys (the admission, the roll calls, the backends,
        Round.store): on a client of its own where the rendezvous is c10d's, because
        torch's heartbeats go through the handler's client, which a store wait holds for
        as long as it waits: a wait there (a member silent while a backend connects, up
        to `group_timeout`) would stop this member's heartbeats, and torch would drop it
        from the rendezvous while its round went on."""
        if self.backend != "c10d":
            return torch_store
        host, port = parse_rendezvous_endpoint(self.endpoint, default_port=29400)
        client = dist.TCPStore(host, port, is_master=False, timeout=self._group_timeout)
        return dist.PrefixStore(f"cgx-round-store/{self.run_id}/{torch_round}/", client)

    def expire(self, torch_round: int, me: int, gone: list[int]) -> None:
        """Tells torch's rendezvous that the ranks `gone` of `torch_round` (where this
        replica is `me`) are: its next round then forms without waiting for their
        heartbeats to stop. Logged where it cannot."""
        try:
            rendezvous_access.expire(self._live_handler(), torch_round, me, gone,
                                     time.monotonic() + self._group_timeout.total_seconds())
        except (RendezvousError, MembershipError, dist.DistError, RuntimeError) as e:
            _log.info("cgx.elastic: run %r: could not tell the rendezvous that ranks %s are gone (%s: %s); it drops "
                      "them after their missed heartbeats", self.run_id, gone, type(e).__name__, e)

    def leave(self) -> None:
        """torch's handler leaves a round only as the first step of joining the next (its
        exit operation, which takes this node out of the round's participants): that step
        alone. Without it the others' next round waits until this node's heartbeats are
        missed 3 times. A rendezvous that cannot be reached any more is left as it is."""
        try:
            rendezvous_access.leave(self._live_handler(),
                                    time.monotonic() + self._group_timeout.total_seconds())
        except (RendezvousError, MembershipError, dist.DistError, RuntimeError) as e:
            _log.info("cgx.elastic: run %r: could not tell the rendezvous that this replica left (%s: %s); the "
                      "others drop it after its missed heartbeats", self.run_id, type(e).__name__, e)

    def end_run(self) -> None:
        self._live_handler().set_closed()

    def close(self) -> None:
        self._handler = None  # its heartbeat timer holds it weakly: no beat after this

    def _live_handler(self):
        if self._handler is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close())")
        return self._handler


def roll_call(rendezvous: Rendezvous, members: Members, wait: datetime.timedelta,
              min_replicas: int) -> Members | None:
    """The members of the failed round `members` that answer a roll call on its store
    within `wait`: every member waits for the others' answers until all have answered or
    its own `wait` has passed since it answered; the first whose wait ends writes the
    verdict (compare-and-set: one verdict for all, whatever each saw), and those in it
    tell torch's rendezvous that the silent ones are gone. None where this replica is no
    longer in torch's round, is not in the verdict (it answered late: it joins again),
    where fewer than `min_replicas` answered, or where the store cannot be reached: then
    the rendezvous decides."""
    me = members.me
    store = dist.PrefixStore(f"cgx-roll-call/{members.epoch}/", members.store)
    try:
        # Only a member of torch's round goes on in it: one that torch dropped (its
        # heartbeats missed) or whose round torch has ended asks the rendezvous.
        if rendezvous.ranks_in(members.torch_round) is None:
            return None
        store.set(f"here/{me}", "1")
        answered = store.add("answered", 1)
        deadline = time.monotonic() + wait.total_seconds()
        while answered < len(members.ranks) and time.monotonic() < deadline:
            time.sleep(0.01)
            answered = store.add("answered", 0)
        here = [r for r in members.ranks if r == me or store.check([f"here/{r}"])]
        verdict = store.compare_set("verdict", "", json.dumps(here)).decode()
    except (MembershipError, dist.DistError, RuntimeError) as e:
        _log.info("cgx.elastic: run %r: the roll call after a failure could not use the round's store (%s: %s); "
                  "the rendezvous forms the next round", rendezvous.run_id, type(e).__name__, e)
        return None
    present = json.loads(verdict)
    gone = [r for r in members.ranks if r not in present]
    if gone and me in present:  # each (where the verdict's writer dies before it does)
        rendezvous.expire(members.torch_round, me, gone)
    if me not in present:
        _log.warning("cgx.elastic: run %r: this replica answered the roll call after a failure too late; it joins "
                     "the run again", rendezvous.run_id)
        return None
    if len(present) < min_replicas:
        return None
    return Members(members.store, members.torch_store, members.torch_round, members.epoch + 1, present,
                   present.index(me), nodes=members.nodes)


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
