"""Admission: the run's secret and terms, checked as a round forms, before its backend
exists (so before a byte of a collective moves), and how a forming round's waits give up
on a member that will not come.

Each member adds a random nonce; the round's challenge is the hash of all of them (no
member chooses it); each proves it holds the secret with an HMAC of the challenge and its
rank, and shows a digest of its terms. Every member then gives its verdict: the members of
earlier rounds refuse a newcomer whose proof fails or whose terms differ. In a round of
newcomers only (the run's start), a failed proof fails every member."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from cgx.backend import GiveUp, gather
from cgx.elastic.rounds import Rendezvous
from cgx.elastic.terms import Terms
from cgx.errors import MembershipError

# The participants of a torch rendezvous round see it complete up to about this far apart
# (each polls the state once a second, read through a cache of a second).
ROUND_SKEW = 2.0
# How often a forming round's waits read torch's rendezvous for members gone from it.
_READ_EVERY = 1.0


class Refused(Exception):
    """This replica is refused by the round it forms: `why` is "secret" or "terms" (the
    members refused it), or "start" (the replicas starting the run hold different
    secrets: ranks `differ` of the round)."""

    def __init__(self, why: str, differ: list[int] | None = None) -> None:
        super().__init__(why)
        self.why, self.differ = why, differ or []


@dataclass
class Admitted:
    beside: list[int]  # the ranks that form the round beside their training
    nodes: list[str]  # every rank's node, as torch's rendezvous names it


def admit(round_store: dist.Store, torch_round: int, rank: int, size: int, *, member: bool, beside: bool,
          terms: Terms, rendezvous: Rendezvous, timeout: datetime.timedelta, give_up: GiveUp) -> Admitted | None:
    """This replica's part in admitting the round `torch_round` (it is `rank` of `size`;
    `member`: it was in an earlier round, so it judges the newcomers; `beside`: it forms
    the round beside its training). Returns who formed it beside and every rank's node, or
    None where it forms again (a replica was refused and leaves, or one went silent:
    `give_up`, see :class:`GiveUpOnTheGone`). Raises :class:`Refused` where this replica
    is refused."""
    store = dist.PrefixStore("cgx-admission/", round_store)

    def gathered(key: str, value: str) -> list[str]:
        return gather(store, key, rank, size, value, timeout, give_up)
    try:
        nonces = gathered("nonce", secrets.token_hex(16))
        challenge = hashlib.sha256("/".join(nonces).encode()).hexdigest()
        claim = {"proof": terms.proof(challenge, rank), "member": member, "terms": terms.digest(),
                 "beside": beside, "node": rendezvous.node()}
        claims = [json.loads(c) for c in gathered("claim", json.dumps(claim))]
        valid = [hmac.compare_digest(c["proof"], terms.proof(challenge, r)) for r, c in enumerate(claims)]
        starting = not any(c["member"] for c in claims)
        nodes = [c["node"] for c in claims]
        verdict: dict[str, Any] = {"refused": {}}
        if member:  # an established member judges the newcomers
            for r, c in enumerate(claims):
                if not valid[r]:
                    verdict["refused"][r] = "secret"
                elif not c["member"] and c["terms"] != terms.digest():
                    verdict["refused"][r] = "terms"
        verdicts = [json.loads(v) for v in gathered("verdict", json.dumps(verdict))]
    except MembershipError:
        raise
    except dist.DistError:
        return None
    if starting:
        _start_together(store, valid, rank, size, timeout)
        return Admitted([], nodes)
    refused = {int(r): why for v in verdicts for r, why in v["refused"].items()}
    if rank in refused:
        raise Refused(refused[rank])
    if refused:
        return None
    return Admitted([r for r, c in enumerate(claims) if c["beside"]], nodes)


def _start_together(store: dist.Store, valid: list[bool], rank: int, size: int,
                    timeout: datetime.timedelta) -> None:
    """The run's start (no member of an earlier round): any failed proof fails every
    member (Refused "start"). (Differing terms fail them too, in the backend's and
    DiLoCo's agreement.)"""
    if all(valid):
        return
    # Each waits until all have read the proofs, so that the one serving the store does
    # not take it away from a slower one. That one may leave while this one's wait is
    # in flight: all have read the proofs by then (this one too), so a lost store
    # changes nothing of the verdict.
    store.set(f"failed/{rank}", "1")
    try:
        store.wait([f"failed/{r}" for r in range(size)], timeout)
    except dist.DistError:
        pass
    raise Refused("start", [r for r in range(size) if not valid[r]])


class GiveUpOnTheGone:
    """How a wait of a forming round (the members `ranks` of rendezvous round
    `torch_round`; this member is rank `me` of it) gives up on a member that will not
    write (DistStoreError: the round forms again without it; MembershipError where the
    rendezvous cannot be read), sooner than the group's timeout: once torch's rendezvous
    no longer holds it in the round (it left, or missed its heartbeats; read once a
    second); and, where this member forms the round beside a round that failed meanwhile
    (`failed_at()` gives when, else None), once it has been silent for `roll_call` after
    that failure and after the wait's start, plus the time the round's participants may
    see it complete apart: it most likely died with the failed round, and is dropped from
    torch's rendezvous, as a roll call drops the silent. (A live member slower than that
    is dropped too: it joins again.) And at once where `cancelled()`: this replica gave
    up forming the round (it closes)."""

    def __init__(self, rendezvous: Rendezvous, torch_round: int, ranks: list[int], me: int,
                 roll_call: datetime.timedelta, failed_at: Callable[[], float | None] | None,
                 cancelled: Callable[[], bool]) -> None:
        self._rendezvous, self._torch_round, self._ranks, self._me = rendezvous, torch_round, ranks, me
        self._roll_call, self._failed_at, self._cancelled = roll_call.total_seconds(), failed_at, cancelled
        self._next_read = time.monotonic() + _READ_EVERY

    def __call__(self, started: float, missing: Callable[[], list[int]]) -> None:
        if self._cancelled():
            raise dist.DistStoreError("this replica gave up forming the round (it closes)")
        now = time.monotonic()
        failed_at = None if self._failed_at is None else self._failed_at()
        if failed_at is not None and now > max(failed_at, started) + self._roll_call + ROUND_SKEW:
            silent = [self._ranks[i] for i in missing()]
            self._rendezvous.expire(self._torch_round, self._me, silent)
            raise dist.DistStoreError(f"ranks {silent} of the forming round are silent after a failure")
        if now >= self._next_read:
            self._next_read = now + _READ_EVERY
            present = self._rendezvous.ranks_in(self._torch_round)
            if present is None:
                raise dist.DistStoreError(f"torch's rendezvous dropped this replica from round {self._torch_round}")
            gone = sorted(set(self._ranks) - present)
            if gone:
                raise dist.DistStoreError(f"ranks {gone} of it left torch's rendezvous")
