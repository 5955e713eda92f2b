"""Every use cgx makes of torch's dynamic rendezvous beyond its public handler API, in
one module (checked against torch 2.11 to 2.13).

The public ``RendezvousHandler`` forms rounds and expires members whose heartbeats stop;
it cannot leave a round without asking for the next one, nor drop a member that the
others know is gone. cgx does both with the handler's own operation executor (the one
its ``next_rendezvous`` and heartbeats run through, under its heartbeat lock), so every
change to the rendezvous state is torch's compare-and-set write, which every rendezvous
backend (c10d, etcd) serves:

- :func:`leave`: torch's exit operation alone (the first step of ``next_rendezvous``).
- :func:`round_of`: the number of the round the handler last joined; :func:`in_round`:
  whether this node is still one of its participants; :func:`ranks_in_round`: the ranks
  of those that still are; :func:`node_of`: how the state names this node;
  :func:`formed_without`: whether a later round formed without this node.
- :func:`expire`: marks the given ranks of that round as having missed their heartbeats,
  so torch removes them at once (its own removal of a dead member, moved forward) and the
  next round forms without waiting 3 heartbeats for them.
- :func:`make_cancellable`: the handler's operations give up as at their deadline once a
  given callable says so (a round formed in the background, abandoned at close()).
"""

from __future__ import annotations

import datetime
import pickle
import time

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousExitOp


def leave(handler, deadline: float) -> None:
    """This node leaves the current round of `handler`'s rendezvous (the others' next
    round forms without it at once). Its heartbeats stop first."""
    handler._stop_heartbeats()
    handler._op_executor.run(_RendezvousExitOp(), deadline)


def round_of(handler) -> int:
    """The round of the rendezvous that `handler` joined last."""
    return handler._state_holder.state.round


def in_round(handler, round_: int) -> bool:
    """Whether this node is still a participant of round `round_`, as the rendezvous
    state says (read again where the handler's copy is older than its cache's second).
    It is not once the round is over or torch dropped this node (3 missed heartbeats)."""
    return ranks_in_round(handler, round_) is not None


def node_of(handler) -> str:
    """How the rendezvous state names this node."""
    return repr(handler._this_node)


def formed_without(handler, round_: int) -> int | None:
    """The number of a round after `round_` that is complete without this node, else
    None. Read from the rendezvous's backend itself, not through the handler's copy of
    the state: a thread of this process may be in the handler's ``next_rendezvous``."""
    response = handler._state_holder._backend.get_state()
    if response is None:
        return None
    state = pickle.loads(response[0])
    if state.round > round_ and state.complete and handler._this_node not in state.participants:
        return state.round
    return None


def ranks_in_round(handler, round_: int) -> set[int] | None:
    """The ranks of round `round_` still in it (torch drops one that leaves or misses 3
    heartbeats), as :func:`in_round` reads them; None where this node is not."""
    state = _state(handler)
    if state.round != round_ or handler._this_node not in state.participants:
        return None
    return set(state.participants.values())


def _state(handler):
    with handler._heartbeat_lock:
        handler._state_holder.sync()
        return handler._state_holder.state


class _Expire:
    """The operation that drops `ranks` of round `round_` (this node is `rank` in it)."""

    _LONG_AGO = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

    def __init__(self, round_: int, rank: int, ranks: list[int]) -> None:
        self.round, self.rank, self.ranks = round_, rank, set(ranks)

    def __call__(self, ctx, deadline: float) -> _Action:
        state = ctx.state
        # Only in the round the ranks belong to, as the member this node was in it: once
        # the round is over, its ranks name nobody.
        if state.round != self.round or not state.complete or state.participants.get(ctx.node) != self.rank:
            return _Action.FINISH
        stale = [node for node, rank in state.participants.items()
                 if rank in self.ranks and node in state.last_heartbeats]
        if not stale:
            return _Action.FINISH
        if time.monotonic() > deadline:
            return _Action.ERROR_TIMEOUT
        for node in stale:
            state.last_heartbeats[node] = self._LONG_AGO
        # Any action but SYNC writes the state back (compare-and-set; read again and
        # retried where another node wrote first); this one also beats this node's heart.
        return _Action.KEEP_ALIVE


def expire(handler, round_: int, rank: int, ranks: list[int], deadline: float) -> None:
    """Drops `ranks` of round `round_` of `handler`'s rendezvous, where this node is
    `rank`, as torch drops members whose heartbeats stopped. Does nothing once that round
    is over."""
    with handler._heartbeat_lock:
        handler._op_executor.run(_Expire(round_, rank, ranks), deadline)


class _CancellableExecutor:
    """The handler's operation executor, whose operations see their deadline passed once
    `cancelled()` is true (it is asked from the thread that runs them)."""

    def __init__(self, executor, cancelled) -> None:
        self._executor, self._cancelled = executor, cancelled

    def run(self, state_handler, deadline: float, *args, **kwargs) -> None:
        def handle(ctx, deadline_: float):
            # Just past, not long past: torch's join then takes this node out of the
            # round it was forming (its rollback, within 5 s of the deadline).
            return state_handler(ctx, time.monotonic() - 0.001 if self._cancelled() else deadline_)
        self._executor.run(handle, deadline, *args, **kwargs)


def make_cancellable(handler, cancelled) -> None:
    """Every later operation of `handler` (its next_rendezvous's exit and join among them)
    gives up as at its deadline once `cancelled()` says so, with torch's own rollback."""
    handler._op_executor = _CancellableExecutor(handler._op_executor, cancelled)
