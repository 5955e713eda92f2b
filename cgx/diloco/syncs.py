"""A fragment's sync, one object per kind: how its outer gradient travels, from its start
to the average the fragment applies.

- :class:`DenseSync`: cgx's compressed allreduce of the outer gradient with the
  agreement's rows after it (beside it, on its own call, where every layer is exact:
  Gloo's sum, then the division).
- :class:`OwnPlacesSync`: top-k with each replica's own places: an all-gather of every
  rank's payload (values and places), decoded and averaged alike on every rank.
- :class:`SharedPlacesSync`: top-k at places every replica draws alike from the sync's
  step: those values in cgx's compressed allreduce, with the rows.
- :class:`Sync` itself: a fragment without members (the rows alone), or a sync that
  arrived completed (a checkpoint's, the state a replica took).

Each kind starts (:func:`start_sync` picks it from the fragment), completes, and is done
again in a new round (:meth:`Sync.redo`) the same way, so that neither the fragment nor
recovery asks which kind it holds."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from cgx import _C
from cgx.counters import count_exact
from cgx.diloco.fragments import Fragment
from cgx.diloco.replicas import ROW, SYNC, Agreement, Replicas, work_of
from cgx.diloco.tensors import local
from cgx.layers import RAW, all_raw, append_segment, layout_bytes

Trained = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Weight:
    """What a replica's outer gradient weighs in a sync: the inner steps behind it (since
    the fragment's last sync started here, or since this replica's local weights restarted
    from the global ones: a joiner's first syncs), of `unit`, the steps a whole interval
    holds (by steps: since the fragment's last sync started, alike on every replica; by
    time: 1). The replica sends its outer gradient times steps / unit and its steps in its
    row; the sync's average is then divided by the steps of all over their units, so each
    replica counts by its steps, and where every replica holds a whole interval nothing is
    multiplied (the plain average, bit for bit)."""

    steps: int
    unit: int = 1

    @property
    def share(self) -> float:
        return self.steps / self.unit


@dataclass(eq=False)
class Sync:
    """A fragment's sync, from its start to the step its result is applied."""

    fragment: Fragment
    due: int  # the step after which it is applied
    agreement: Agreement
    outer_gradient: torch.Tensor | None  # flat float32, the average once the work completed; None: no members
    residual: torch.Tensor | None  # this rank's error feedback, updated by the collective
    work: Any  # the collective's Work (the agreement's too, but beside an exact sync); None once it completed
    sent: torch.Tensor | None = None  # elastic runs: a copy of what this rank put in, to do the sync again
    checked: bool = False  # the agreement was checked (a sync completed before its replicas re-formed)
    drift: torch.Tensor | None = None  # a sparse sync's outer gradient as measured (with error feedback)
    weight: Weight | None = None  # what this rank's outer gradient weighs (None: no members)

    @property
    def completed(self) -> bool:
        return self.work is None and self.agreement.work is None

    @property
    def key(self) -> tuple[int, int]:
        """(fragment, start step; by time: its number): the sync, alike on every replica."""
        return self.fragment.index, self.agreement.step

    @classmethod
    def arrived(cls, fragment: Fragment, step: int, due: int, trained: Trained, sent: torch.Tensor | None) -> Sync:
        """A sync of inner step `step` whose average arrives from another replica (its
        state, taken): completed, the average to be filled in. `sent`: what this rank sent
        into it, where it had started it too (kept to do it again)."""
        members = fragment.members
        gradient = torch.zeros(fragment.numel, device=members[0].global_weight.device) if members else None
        if sent is not None and sent.numel() != fragment.numel:
            sent = None
        agreement = Agreement(SYNC, step, trained, torch.zeros(1, ROW), None)
        return cls(fragment, due, agreement, gradient, None, None, sent, checked=True)

    def finish(self, replicas: Replicas, overlap: int, mix: float) -> list[int]:
        """At the step it is due: checks the agreement its rows carried (raises on every
        rank alike where the replicas differ), waits for its collective (a wait, in the
        stats, where it was not complete yet: always without overlap) and applies it.
        Returns what each replica's row says of joiners (empty where the agreement was
        checked before)."""
        stats, started = replicas.stats, time.perf_counter()
        waits = self.work is not None and (overlap == 0 or not self.work.is_completed())
        joiners: list[int] = []
        # The agreement first: beside an exact sync it is a call of its own, and where the
        # replicas are out of step the exact sync's Gloo call has no partner to wait for.
        if not self.checked:
            replicas.check(self.agreement)
            self.checked = True
            joiners = [int(v) for v in self.agreement.rows[:, 2].tolist()]
        if self.outer_gradient is None:
            return joiners
        if self.work is not None:
            stats["waits"] += waits  # without overlap the step always waits
            self.complete(replicas)
            stats["wait_seconds"] += time.perf_counter() - started
        self.apply(replicas, overlap, mix)
        return joiners

    def complete(self, replicas: Replicas) -> None:
        """Waits for the sync's collective and its rows, makes the average, and counts
        the payload as it went (the agreement's rows are not counted)."""
        if self.agreement.work is not None:
            replicas.wait(self.agreement)
        if self.work is None:
            return
        self.work.wait()
        self._average(replicas)
        if self.weight is not None:
            self._weigh(replicas)
        self.work = None

    def ready(self) -> bool:
        """Whether its collective and rows have completed (without waiting for them)."""
        return all(w is None or w.is_completed() for w in (self.work, self.agreement.work))

    def _weigh(self, replicas: Replicas) -> None:
        """The average of what the ranks sent (each its outer gradient times its share of
        an interval, Weight) over their shares in all. Where no rank stepped (a sync done
        again that nobody sent into), nothing moves."""
        total, whole = sum(work_of(self.agreement.rows)), replicas.size * self.weight.unit
        if total != whole:
            self.outer_gradient.mul_(whole / total if total else 0.0)

    def _average(self, replicas: Replicas) -> None:
        """The kind's average, once its collective completed (none without members)."""

    def apply(self, replicas: Replicas, overlap: int, mix: float) -> None:
        """The fragment takes the outer step on its global weights, keeps the residuals the collective
        left, and restarts the local weights from the global ones (mixed, with overlap).
        A sparse sync's residual holds all of what this rank did not send; with overlap and
        mix, the local weights keep `mix` of their drift from the new global weights, which
        the next outer gradient measures again: that part leaves the residual (it would be
        sent twice: random places, sent rarely, diverged so)."""
        fragment = self.fragment
        with torch.no_grad():
            retains = self.drift is not None and self.residual is not None and overlap > 0 and mix > 0
            before = torch.cat([m.global_weight.reshape(-1) for m in fragment.members]) if retains else None
            offset = 0
            for m in fragment.members:
                g = m.global_weight
                g.grad = self.outer_gradient.narrow(0, offset, g.numel()).view_as(g)
                offset += g.numel()
            fragment.outer.step()
            if retains:
                stepped = before.sub_(torch.cat([m.global_weight.reshape(-1) for m in fragment.members]))
                share = 1.0 if self.weight is None else self.weight.share
                self.residual.sub_((self.drift - stepped).mul_(mix * share))
            if self.residual is not None:
                replicas.residuals.keep(self.residual, fragment.compressed)
            for m in fragment.members:
                g, weights = m.global_weight, local(m.param)
                g.grad = None
                weights.copy_(g if overlap == 0 else torch.lerp(g, weights.float(), mix))
        replicas.stats["outer_syncs"] += 1
        fragment.syncs += 1

    def keep_residual_at_reform(self) -> None:
        """The replicas re-formed around this sync: its residual, the old round's rank's,
        is dropped (residuals belong to a rank of a round), but where the kind keeps
        what this rank alone did not send."""
        self.residual = None

    def redo(self, replicas: Replicas, error_feedback: bool) -> Sync:
        """This sync done again among `replicas` (a new round): this rank sends what it
        sent before, weighing what it weighed then, or zeros where it did not send into it,
        weighing nothing (the average is over those that sent); the sync's kind follows its
        fragment."""
        fragment = self.fragment
        delta, weight = None, None
        if fragment.members:
            delta = (self.sent.clone() if self.sent is not None
                     else torch.zeros(fragment.numel, device=fragment.members[0].global_weight.device))
            unit = 1 if self.weight is None else self.weight.unit
            weight = self.weight if self.sent is not None and self.weight is not None else Weight(0, unit)
        again = start_sync(fragment, replicas, self.agreement.step, self.due, error_feedback,
                           self.agreement.trained, 0, delta=delta, weight=weight)
        if again.drift is not None and self.sent is not None:
            again.drift = self.sent  # what the local weights drifted, not the weighed contribution
        again.sent = self.sent
        return again


@dataclass(eq=False)
class DenseSync(Sync):
    """The outer gradient in cgx's compressed allreduce (Gloo's exact average where every
    layer is exact)."""

    def _average(self, replicas: Replicas) -> None:
        fragment = self.fragment
        sent_exactly = _C.sent_exactly(self.work)
        _count(replicas.stats, layout_bytes(fragment.layout, replicas.skip_incomplete, sent_exactly),
               4 * fragment.numel, "policy" if all_raw(fragment.layout) else "auto" if sent_exactly else None)

    @classmethod
    def start(cls, fragment: Fragment, replicas: Replicas, step: int, due: int, trained: Trained,
              rows: torch.Tensor, delta: torch.Tensor, error_feedback: bool, sent: torch.Tensor | None) -> DenseSync:
        exact_sync = all_raw(fragment.layout)
        flat = torch.cat([delta, *([] if exact_sync else [rows.view(-1)])])
        residual = None
        if error_feedback and fragment.compressed:
            residual = replicas.residuals.gather(flat.numel(), fragment.compressed, flat.device)
        if exact_sync:
            agreement = replicas.agree(SYNC, step, trained, rows)
            work = replicas.exact_average(flat)
        else:
            layout = list(fragment.layout)
            append_segment(layout, fragment.numel, rows.numel(), RAW)
            work = replicas.backend.allreduce_layout(flat, layout, average=True, residual=residual)
            agreement = Agreement(SYNC, step, trained, flat[fragment.numel:].view_as(rows), work)
        return cls(fragment, due, agreement, flat[:fragment.numel], residual, work, sent)


@dataclass(eq=False)
class OwnPlacesSync(Sync):
    """Each rank's top-k payload (values and places), all-gathered; the average is every
    rank's payload decoded and summed in rank order (alike on every rank), over the ranks.
    Its residual is what this rank did not send, its own, set as the sync started: kept
    when the replicas re-form (dropped, the residual from before it would send again what
    it sent)."""

    payloads: list[torch.Tensor] | None = None  # every rank's, once `work` completed

    def _average(self, replicas: Replicas) -> None:
        sparse = self.fragment.sparse
        self.outer_gradient.zero_()
        for payload in self.payloads:
            sparse.add(payload, self.outer_gradient)
        self.outer_gradient.div_(len(self.payloads))
        _count(replicas.stats, sparse.nbytes, 4 * self.fragment.numel)
        self.payloads = None

    def keep_residual_at_reform(self) -> None:
        pass

    @classmethod
    def start(cls, fragment: Fragment, replicas: Replicas, step: int, due: int, trained: Trained,
              rows: torch.Tensor, delta: torch.Tensor, error_feedback: bool, sent: torch.Tensor | None) -> OwnPlacesSync:
        """This rank's payload (delta plus its residual, decayed) and the all-gather of
        every rank's (the rows on a call of their own); the residual becomes what the
        payload does not carry."""
        agreement = replicas.agree(SYNC, step, trained, rows)
        values, residual = _with_residual(fragment, replicas, delta, error_feedback)
        payload = fragment.sparse.encode(values, residual)
        payloads = [torch.empty_like(payload) for _ in range(replicas.size)]
        work = replicas.backend.allgather([payloads], [payload])
        return cls(fragment, due, agreement, torch.zeros_like(delta), residual, work, sent, payloads=payloads)


@dataclass(eq=False)
class SharedPlacesSync(Sync):
    """The values at the places every replica draws from the sync's step, in cgx's
    compressed allreduce with the rows. The residual becomes the values, but at the
    places sent: what the allreduce dropped of them (filled in at completion)."""

    places: list[torch.Tensor | None] | None = None  # SparsePlan.shared_places
    averaged: torch.Tensor | None = None  # the allreduce's values (the average, once it completed)
    dropped: torch.Tensor | None = None  # what the allreduce's quantizations dropped (error feedback)

    def _average(self, replicas: Replicas) -> None:
        sparse = self.fragment.sparse
        sparse.put(self.averaged, self.places, self.outer_gradient)
        if self.residual is not None:
            sparse.put(self.dropped.narrow(0, 0, self.averaged.numel()), self.places, self.residual)
        sent_exactly = _C.sent_exactly(self.work)
        sent = layout_bytes(sparse.selected_layout(), replicas.skip_incomplete, sent_exactly)
        _count(replicas.stats, sent, 4 * self.fragment.numel, "auto" if sent_exactly else None)
        self.places = self.averaged = self.dropped = None

    @classmethod
    def start(cls, fragment: Fragment, replicas: Replicas, step: int, due: int, trained: Trained,
              rows: torch.Tensor, delta: torch.Tensor, error_feedback: bool, sent: torch.Tensor | None) -> SharedPlacesSync:
        values, residual = _with_residual(fragment, replicas, delta, error_feedback)
        places = fragment.sparse.shared_places(step * 65536 + fragment.index, delta.device)
        selected = fragment.sparse.select(values, places)
        flat = torch.cat([selected, rows.view(-1)])
        layout = fragment.sparse.selected_layout()
        append_segment(layout, selected.numel(), rows.numel(), RAW)
        dropped = torch.zeros_like(flat) if residual is not None else None
        work = replicas.backend.allreduce_layout(flat, layout, average=True, residual=dropped)
        if residual is not None:
            residual.copy_(values)
        agreement = Agreement(SYNC, step, trained, flat[selected.numel():].view_as(rows), work)
        return cls(fragment, due, agreement, torch.zeros_like(delta), residual, work, sent,
                   places=places, averaged=flat[:selected.numel()], dropped=dropped)


def start_sync(fragment: Fragment, replicas: Replicas, step: int, due: int, error_feedback: bool, trained: Trained,
               strangers: int, joiners: int = 0, keep: bool = False, state: int = 0,
               delta: torch.Tensor | None = None, weight: Weight | None = None) -> Sync:
    """Starts the fragment's sync of inner step `step` (under a time schedule: of number
    `step`), of the kind its fragment takes: the outer gradient (global - local; `delta`
    instead, for a sync done again) times `weight`'s share, with the agreement's rows
    (`state`: a digest of the fragment's state, or 0; the weight's steps). With `keep` (an
    elastic run), the sync keeps a copy of the outer gradient as measured."""
    # The rows travel with the outer gradient, so they live on its device.
    members = fragment.members
    device = members[0].global_weight.device if members else torch.device("cpu")
    rows = replicas.rows(SYNC, step, trained, strangers, device, joiners, state, 0 if weight is None else weight.steps)
    if not members:  # the replicas still agree, on their step above all
        return Sync(fragment, due, replicas.agree(SYNC, step, trained, rows), None, None, None)
    with torch.no_grad():
        if delta is None:
            delta = torch.cat([(m.global_weight - local(m.param).float()).reshape(-1) for m in members])
        sent = delta.clone() if keep else None
        drift = None  # (unscaled; one copy with `sent`: neither is written after)
        if fragment.sparse is not None and error_feedback and fragment.compressed:
            drift = sent if sent is not None else delta.clone()
        if weight is not None and weight.steps != weight.unit:
            delta.mul_(weight.share)
        kind = DenseSync if fragment.sparse is None else SharedPlacesSync if fragment.top_k.shared else OwnPlacesSync
        sync = kind.start(fragment, replicas, step, due, trained, rows, delta, error_feedback, sent)
    sync.drift, sync.weight = drift, weight
    return sync


def arrived(fragments: list[Fragment], in_flight: list[tuple[tuple[int, int], int, Trained, Weight | None]],
            mine: list[Sync], due: int | None = None) -> list[Sync]:
    """The syncs in flight of another replica's layout (`in_flight`: each key, due step,
    trained set and weight), arrived completed (Sync.arrived), due where they were
    there (or at `due`: under a time schedule, where this replica's own step count goes
    on); one this replica also has (`mine`) keeps what it sent into it and the weight it
    sent with, so that it can be done again with them."""
    own = {s.key: s for s in mine}
    syncs = []
    for key, their_due, trained, weight in in_flight:
        index, start = key
        had = own.get(tuple(key))
        sync = Sync.arrived(fragments[index], start, their_due if due is None else due, trained,
                            None if had is None else had.sent)
        sync.weight = weight if had is None else had.weight
        syncs.append(sync)
    return syncs


def _with_residual(fragment: Fragment, replicas: Replicas, delta: torch.Tensor,
                   error_feedback: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sparse sync's values, delta plus this rank's residual times the decay, and the
    residual (None without error feedback)."""
    if not (error_feedback and fragment.compressed):
        return delta, None
    residual = replicas.residuals.gather(fragment.numel, fragment.compressed, delta.device)
    return delta + fragment.top_k.decay * residual, residual


def _count(stats: dict, payload_bytes: int, uncompressed_payload_bytes: int, exact: str | None = None) -> None:
    """A completed sync's payload in the stats (the agreement's rows are not counted);
    `exact`: why it went the exact way, if it did."""
    if exact is not None:
        count_exact(stats, exact, payload_bytes)
    stats["payload_bytes"] += payload_bytes
    stats["uncompressed_payload_bytes"] += uncompressed_payload_bytes
    stats["peak_payload_bytes"] = max(stats["peak_payload_bytes"], payload_bytes)
