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
(:meth:`Membership.joiners_waiting`); every member then calls :meth:`next_round`.

Example (one replica of a run; every replica runs the same)::

    membership = cgx.elastic.Membership("site-a.example:29400", "run-42", min_replicas=2)
    round_ = membership.next_round()            # waits for at least 2 replicas
    work = round_.backend.allreduce([tensor])   # a cgx backend of round_.size members
    ...
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

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousError, RendezvousParameters,
                                                  RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from cgx import _C
from cgx.backend import new_backend, with_process_settings
from cgx.config import Config, check_int
from cgx.errors import MembershipError

__all__ = ["Membership", "Round"]


@dataclass(eq=False)
class Round:
    """One round of the run, as this member sees it."""

    rank: int  # this member's rank in the round (0..size-1; a member's rank may change between rounds)
    size: int  # the members of the round
    backend: _C.ProcessGroupCGX  # the round's cgx backend: collectives among its members
    store: dist.Store  # the round's store (torch prefixes it per round)


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
        group_timeout: each round's backend's timeout (a collective with a dead or
            silent member raises within it).
        config: the rounds' backend settings (default: the ``CGX_*`` variables).
        secret: the run's secret, which every replica must hold to join (read it from a
            file or an environment variable, never a command-line argument, where other
            users of the machine could read it). Checked at every round before its
            backend exists: a replica without it is refused (:class:`cgx.MembershipError`
            on it) and the members go on without it. It does not encrypt anything: the
            rounds' traffic (Gloo's TCP) and the rendezvous store are plain; tunnel them
            between sites.
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
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"{what}: run_id must be a non-empty string, got {run_id!r}")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"{what}: config must be a cgx.Config, got {type(config).__name__}")
        if config is not None:  # a bad CGX_SHM_NAME_TAG fails here, on this replica alone, not in a round
            config = with_process_settings(config)
        options: dict[str, Any] = {
            "join_timeout": str(_whole_seconds(join_timeout, "join_timeout")),
            "last_call_timeout": str(_whole_seconds(last_call, "last_call")),
            "keep_alive_interval": str(_whole_seconds(heartbeat, "heartbeat")),
            "keep_alive_max_attempt": "3",
        }
        if is_host is not None:
            options["is_host"] = bool(is_host)
        self.run_id = run_id
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        # How the others' logs and stats name this replica (a restarted one is a new replica).
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"
        self.group_timeout, self.join_timeout = group_timeout, join_timeout
        self.config = config
        self.round: Round | None = None
        self.rounds = 0  # rounds this replica was a member of
        parameters = RendezvousParameters(backend=rendezvous, endpoint=endpoint, run_id=run_id,
                                          min_nodes=min_replicas, max_nodes=max_replicas, **options)
        try:
            self._handler = get_rendezvous_handler(parameters)
        except (RendezvousError, RuntimeError, ValueError) as e:
            raise MembershipError(f"{what}: cannot reach the rendezvous of run {run_id!r} at {endpoint}: {e}") from e

    def next_round(self) -> Round:
        """Leaves the current round (its backend is shut down) and waits for the next one
        to form: the members still present, and those that were waiting to join. Every
        member calls it: after a collective of the round failed, or to admit joiners.
        Raises :class:`cgx.MembershipError` where no round forms within `join_timeout`
        (fewer than `min_replicas` present) or the rendezvous cannot be reached."""
        self._leave_round()
        while True:
            info = self._rendezvous()
            if self._admitted_everyone(info):
                break
            # A replica without the run's secret was refused: it leaves (its heartbeats
            # stop), and the members form the round again without it.
        self.round = Round(info.rank, info.world_size, self._backend_of(info), info.store)
        self.rounds += 1
        return self.round

    def _rendezvous(self):
        if self._handler is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close())")
        try:
            with _unshared_bootstrap_store():
                return self._handler.next_rendezvous()
        except RendezvousClosedError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r} has ended: a replica called end_run() "
                                  f"(the rendezvous is closed)") from e
        except RendezvousTimeoutError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: no round formed: fewer than "
                                  f"min_replicas={self.min_replicas} replicas came within "
                                  f"join_timeout={self.join_timeout} ({type(e).__name__} from torch's "
                                  f"rendezvous{': ' + str(e) if str(e) else ''})") from e
        except RendezvousError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: no round formed: "
                                  f"{type(e).__name__}: {e}") from e

    def _admitted_everyone(self, info) -> bool:
        """The run's secret, checked before the round's backend exists (so before a byte
        of a collective moves). Each member adds a random nonce; the round's challenge is
        the hash of all of them (no member chooses it); each member proves it holds the
        secret with an HMAC of the challenge and its rank. The members of earlier rounds
        judge: a newcomer whose proof fails is refused (MembershipError on it; it leaves,
        and they form the round again without it: True means go on). In a round of
        newcomers only (the run's start), any failed proof fails every member."""
        store = dist.PrefixStore("cgx-admission/", info.store)
        ranks = range(info.world_size)
        store.set(f"nonce/{info.rank}", secrets.token_hex(16))
        challenge = hashlib.sha256("/".join(store.get(f"nonce/{r}").decode() for r in ranks).encode()).hexdigest()
        store.set(f"proof/{info.rank}", json.dumps([self._proof(challenge, info.rank), self.rounds > 0]))
        claims = [json.loads(store.get(f"proof/{r}")) for r in ranks]
        valid = [hmac.compare_digest(proof, self._proof(challenge, r)) for r, (proof, _) in enumerate(claims)]
        established = [r for r, (_, member) in enumerate(claims) if member]
        if self.rounds > 0:  # an established member's verdict
            refused = [r for r in ranks if not valid[r]]
            store.set(f"verdict/{info.rank}", json.dumps(refused))
            return not refused
        if established:  # a newcomer waits for the members' verdict on it
            refused_by = [r for r in established
                          if info.rank in json.loads(store.get(f"verdict/{r}"))]
            if refused_by:
                self.close()
                raise MembershipError(
                    f"cgx.elastic: run {self.run_id!r} refused this replica: it does not hold the run's secret "
                    f"(Membership(secret=...)), so it cannot join (nothing was sent to the run)")
            return True
        if not all(valid):
            # Every member fails; each waits until all have read the proofs, so that the
            # one serving the store does not take it away from a slower one. That one
            # may leave while this one's wait is in flight: all have read the proofs by
            # then (this one too), so a lost store changes nothing of the verdict.
            store.set(f"failed/{info.rank}", "1")
            try:
                store.wait([f"failed/{r}" for r in ranks])
            except dist.DistError:
                pass
            self.close()
            raise MembershipError(
                f"cgx.elastic: run {self.run_id!r}: the replicas starting it do not hold the same secret "
                f"(ranks {[r for r in ranks if not valid[r]]} of this round differ from this one): every replica "
                f"must be given the run's secret (or none)")
        return True

    def _proof(self, challenge: str, rank: int) -> str:
        """This replica's proof for `rank` of a round with `challenge` ("" without a secret)."""
        if self._secret is None:
            return ""
        message = f"cgx-elastic/{self.run_id}/{challenge}/{rank}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def joiners_waiting(self) -> int:
        """How many replicas wait to join (admitted by the members' next :meth:`next_round`)."""
        if self._handler is None:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: this replica left the run (close())")
        try:
            return self._handler.num_nodes_waiting()
        except RendezvousError as e:
            raise MembershipError(f"cgx.elastic: run {self.run_id!r}: the rendezvous cannot be read: {e}") from e

    def close(self) -> None:
        """Leaves the run, which goes on: the round's backend is shut down and this
        replica's heartbeats stop, so the others' next round forms without it (after 3
        missed heartbeats). A second call does nothing. (torch's ``shutdown()`` would
        close the rendezvous for every replica: that is :meth:`end_run`.)"""
        self._leave_round()
        self._handler = None  # its heartbeat timer holds it weakly: no beat after this

    def end_run(self) -> None:
        """Ends the run for every replica: the rendezvous is closed (no round forms any
        more; the others' next :meth:`next_round` raises, saying so). This replica stays
        until :meth:`close`; the replica that serves the c10d store should close last,
        as the store goes with it."""
        if self._handler is not None:
            self._handler.set_closed()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _leave_round(self) -> None:
        if self.round is not None:
            self.round.backend.shutdown()
            self.round = None

    def _backend_of(self, info) -> _C.ProcessGroupCGX:
        """The round's cgx backend, made as a group's is, on the round's store."""
        return new_backend(dist.PrefixStore("cgx-round/", info.store), info.rank, info.world_size,
                           self.group_timeout, self.config)


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
