"""The run's terms and secret: what every replica of an elastic run must hold alike, and
the proofs that it holds the run's secret.

The members publish the terms on the rendezvous's own store (c10d's), tagged with an HMAC
under the secret; a replica not yet in the run reads them before it enters the
rendezvous and refuses itself where it cannot make the tag or its terms differ, at no
cost to the members. As a round forms, each member proves the secret again with an HMAC
of the round's challenge (admission.py)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from cgx.errors import MembershipError


class Terms:
    """The terms of run `run_id` as this replica holds them, and its secret (None: the run
    has none). `endpoint` and `rendezvous` name the rendezvous whose store holds the
    published terms (c10d's only; another backend checks them as a round forms)."""

    def __init__(self, run_id: str, secret: bytes | None, endpoint: str, rendezvous: str,
                 timeout: datetime.timedelta) -> None:
        self.run_id = run_id
        self._secret = secret
        self._endpoint, self._rendezvous, self._timeout = endpoint, rendezvous, timeout
        self._parts: dict[str, Any] = {}
        self._store: dist.Store | None = None  # the rendezvous's store, as the terms' (made when needed)

    def set(self, part: str, terms: Any) -> None:
        """Sets `part` (JSON-able; values JSON does not know are compared as ``str()``)."""
        self._parts[part] = json.loads(json.dumps(terms, sort_keys=True, default=str))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self._parts, sort_keys=True).encode()).hexdigest()

    def proof(self, challenge: str, rank: int) -> str:
        """This replica's proof for `rank` of a round with `challenge` ("" without a secret)."""
        if self._secret is None:
            return ""
        message = f"cgx-elastic/{self.run_id}/{challenge}/{rank}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check_before_joining(self, reach: Callable[[Callable[[], Any]], Any]) -> None:
        """Admission before membership: reads the terms the run's members published and
        raises where this replica does not hold the run's secret (MembershipError) or its
        terms differ (ValueError naming the first difference). Where none are published the
        run has not started: this replica's first round starts it. A part this replica
        holds that the run has not published yet (a member builds cgx.DiLoCo after its
        first round) is not refused here: the round's admission compares every part.
        `reach` reads the store (MembershipError where it cannot)."""
        store = self._terms_store()
        if store is None or not reach(lambda: store.check([self._key])):
            return
        published = json.loads(reach(lambda: store.get(self._key)))
        if not hmac.compare_digest(published["tag"], self._tag(published["terms"])):
            holds = "the run's secret" if self._secret is not None else "a secret (Membership(secret=...))"
            raise MembershipError(f"cgx.elastic: run {self.run_id!r} refused this replica before it joined: it does "
                                  f"not hold {holds}, so it cannot join (nothing was sent to the run)")
        run = json.loads(published["terms"])
        difference = first_difference(run, {part: v for part, v in self._parts.items() if part in run})
        if difference:
            raise ValueError(f"cgx.elastic: run {self.run_id!r} refused this replica before it joined: "
                             f"{difference}; every replica of a run must be built alike (nothing was sent to the run)")

    def publish(self) -> None:
        text = json.dumps(self._parts, sort_keys=True)
        store = self._terms_store()
        if store is not None:
            store.set(self._key, json.dumps({"terms": text, "tag": self._tag(text)}))

    def started(self, reach: Callable[[Callable[[], Any]], Any]) -> bool:
        """Whether a member marked the run started (mark_started)."""
        store = self._terms_store()
        return store is not None and bool(reach(lambda: store.check([self._started_key])))

    def mark_started(self, reach: Callable[[Callable[[], Any]], Any]) -> None:
        store = self._terms_store()
        if store is not None:
            reach(lambda: store.set(self._started_key, "1"))

    def close(self) -> None:
        self._store = None

    @property
    def _key(self) -> str:
        return f"cgx-terms/{self.run_id}"

    @property
    def _started_key(self) -> str:
        return f"cgx-started/{self.run_id}"

    def _terms_store(self) -> dist.Store | None:
        """A client of the rendezvous's own store (the c10d backend's), which outlives
        the rounds. None for another rendezvous backend."""
        if self._store is None and self._rendezvous == "c10d":
            host, port = parse_rendezvous_endpoint(self._endpoint, default_port=29400)
            try:
                self._store = dist.TCPStore(host, port, is_master=False, timeout=self._timeout)
            except (RuntimeError, ValueError) as e:
                raise MembershipError(f"cgx.elastic: cannot reach the rendezvous of run {self.run_id!r} at "
                                      f"{self._endpoint}: {e}") from e
        return self._store

    def _tag(self, terms: str) -> str:
        """The terms' tag: only a holder of the run's secret makes it ("" without a secret)."""
        if self._secret is None:
            return ""
        return hmac.new(self._secret, f"cgx-elastic-terms/{self.run_id}/{terms}".encode(), hashlib.sha256).hexdigest()


def first_difference(run: dict[str, Any], mine: dict[str, Any]) -> str | None:
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
