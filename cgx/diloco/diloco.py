"""Streaming DiLoCo: replicas train alone and sync fragments of the model rarely, compressed.

Each replica (a rank, or a host's DDP / FSDP2 group) takes its inner optimizer's steps on
its own data. Every ``sync_every`` steps each parameter is synchronized once: the outer
gradient (global copy - local weights, float32) is averaged over ``group`` with cgx's
compressed allreduce (per-layer layout, error-feedback residual per parameter), an outer
Nesterov SGD updates the global copy, and the local weights restart from it. The model is
cut into ``fragments`` groups of whole layers that sync at staggered steps, so the link
carries 1/P of the model at a time; with ``overlap=k`` a fragment's allreduce runs while
the next k inner steps compute, and its result is merged into the local weights then
(Douillard et al. 2023, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512)::

    import cgx
    dist.init_process_group("cgx")
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = cgx.DiLoCo(model, inner, sync_every=32, fragments=4, bits=4, overlap=1)
    for batch in data:                       # the training loop does not change
        loss = model(batch).loss; loss.backward(); inner.step(); inner.zero_grad()
    diloco.close()                           # or: with cgx.DiLoCo(...) as diloco:

The syncs run from a step post-hook on the inner optimizer. Only parameters that the
inner optimizer updates are synchronized (buffers such as BatchNorm statistics stay each
replica's own), and that set follows the optimizer: every sync carries a small exact
agreement of the replicas' inner step and trained parameters, so parameters that join
(a param group added, a layer unfrozen) or leave it do so on every replica at the same
step, and replicas out of step or training different parameters raise on every rank. Under FSDP2 the outer step runs on each rank's local shards; ``group`` then pairs
the ranks holding the same shard in each replica.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from cgx.backend import resolve_group
from cgx.config import check_int, is_int
from cgx.counters import Stats
from cgx.diloco.checkpoint import check_state, loaded, saved
from cgx.diloco.clock import SyncClock
from cgx.diloco.fragments import PATTERNS, Fragments, synced_parameters
from cgx.diloco.recovery import Recoverable, Recovery
from cgx.diloco.replica_host import CHANGED, CLOSED, FAILED, LEFT, UNCHANGED, ReplicaHost
from cgx.diloco.replicas import Replicas
from cgx.diloco.sparse import TopK
from cgx.diloco.syncs import Sync, arrived
from cgx.diloco.turns import Turns
from cgx.elastic import Membership
from cgx.layers import RAW_BITS, CompressionPolicy, check_bits, check_bucket_size
from cgx.residuals import Residuals

__all__ = ["DiLoCo"]

_log = logging.getLogger("cgx.diloco")

@dataclasses.dataclass(frozen=True)
class _Schedule:
    """The hyper-parameters every replica must share (compared over the group at
    construction, in this order), checked."""

    sync_every: int | datetime.timedelta  # inner steps, or a time (the time schedule)
    fragments: int
    fragment_pattern: str
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    overlap: int
    mix: float
    error_feedback: bool
    top_k: TopK | None = None

    def __post_init__(self) -> None:
        what = "cgx.DiLoCo"
        if self.top_k is not None and not isinstance(self.top_k, TopK):
            raise TypeError(f"{what}: top_k must be a cgx.diloco.TopK or None, got {type(self.top_k).__name__}")
        check_int(self.fragments, "fragments", what, low=1)
        check_int(self.overlap, "overlap", what)
        if self.by_time:
            if not self.sync_every > datetime.timedelta(0):
                raise ValueError(f"{what}: sync_every={self.sync_every!r} must be a time above zero")
        else:
            if not (is_int(self.sync_every) and self.sync_every >= 1):
                raise ValueError(f"{what}: sync_every must be an integer >= 1 (inner steps) or a "
                                 f"datetime.timedelta (a time), got {self.sync_every!r}")
            if self.fragments > self.sync_every:
                raise ValueError(f"{what}: fragments={self.fragments} is more than sync_every={self.sync_every} "
                                 f"(fragments sync at distinct steps within sync_every)")
            if self.overlap >= self.sync_every:
                raise ValueError(f"{what}: overlap={self.overlap} must be less than sync_every={self.sync_every} "
                                 f"(a fragment's sync must be applied before its next one starts)")
        if not isinstance(self.outer_lr, (int, float)) or not self.outer_lr > 0:
            raise ValueError(f"{what}: outer_lr must be > 0, got {self.outer_lr!r}")
        if not isinstance(self.outer_momentum, (int, float)) or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"{what}: outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError(f"{what}: nesterov needs outer_momentum > 0")
        if not isinstance(self.mix, (int, float)) or not 0 <= self.mix <= 1:
            raise ValueError(f"{what}: mix must be in [0, 1], got {self.mix!r}")
        if self.fragment_pattern not in PATTERNS:
            raise ValueError(f"{what}: fragment_pattern must be one of {PATTERNS}, got {self.fragment_pattern!r}")
        # As every replica compares them: numbers as floats, switches as bools.
        for name, kind in (("outer_lr", float), ("outer_momentum", float), ("mix", float), ("nesterov", bool),
                           ("error_feedback", bool)):
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def by_time(self) -> bool:
        """Whether syncs fall due by time (sync_every a timedelta), not by inner steps."""
        return isinstance(self.sync_every, datetime.timedelta)

    @property
    def outer_options(self) -> dict[str, Any]:
        """The outer SGD's arguments."""
        return {"lr": self.outer_lr, "momentum": self.outer_momentum, "nesterov": self.nesterov}


def _schedule_field(name: str) -> property:
    """DiLoCo's attribute for the hyper-parameter `name` of its _Schedule."""
    def set_field(self, value: Any) -> None:
        schedule = dataclasses.replace(self._schedule, **{name: value})
        if schedule.by_time != self._schedule.by_time:
            raise ValueError(f"cgx.DiLoCo: sync_every={value!r}: a run keeps the kind of schedule it was built "
                             f"with ({'a time' if self._schedule.by_time else 'inner steps'})")
        if schedule.by_time:  # the syncs keep their numbers; the next falls due from the last one's deadline
            self._clock.retime(schedule.sync_every, self.syncs_started)
        # The fragments keep their offsets (a sync in flight is never moved): one at or
        # above sync_every would never sync again.
        stranded = [] if schedule.by_time else [f for f in self._fragments.all if f.offset >= schedule.sync_every]
        if stranded:
            raise ValueError(f"cgx.DiLoCo: sync_every={schedule.sync_every} leaves fragment(s) "
                             f"{[f.index for f in stranded]} (offsets {[f.offset for f in stranded]}, fixed at "
                             f"construction) without a step to sync at; sync_every must stay above "
                             f"{max(f.offset for f in self._fragments.all)}")
        self._schedule = schedule
    return property(lambda self: getattr(self._schedule, name), set_field)


class DiLoCo(Turns):
    """Streaming DiLoCo on the inner optimizer of `model`.

    Args:
        model: the replica's model (plain, DDP- or FSDP2-wrapped); its parameters that
            `inner_optimizer` updates are synchronized, named as ``named_parameters()``.
            That set follows the optimizer: parameters that start or stop being trained
            (param groups added, layers (un)frozen) join or leave it at the next sync.
        inner_optimizer: the optimizer the training loop steps; DiLoCo hooks its steps.
        sync_every: inner steps between two syncs of a parameter (H); or a
            ``datetime.timedelta`` (the time schedule, for replicas of unequal speed):
            each replica trains that long between two syncs of a fragment, and each
            sync weighs a replica by its inner steps, so none waits for a slower one
            (docs/diloco.md, "Replicas of unequal speed"). End every replica's loop at
            the same :attr:`syncs_started`.
        fragments: groups of whole layers that sync at staggered steps (P); fragment p
            syncs at the steps t > 0 with ``t % sync_every == p * sync_every // fragments``
            (by time: at the sync numbers k with ``k % fragments == p``).
        fragment_pattern: "strided" (layers in model order each go to the fragment with
            the fewest elements so far, ties to the next in turn: layer i to fragment
            i mod P where layers are alike) or "sequential" (runs of consecutive layers
            of about 1/P of the elements each).
        bits, bucket_size: how outer gradients travel (1..8 bits, or 32 for exact
            DiLoCo; the bucket size and the scheme are the group's). 1-D and small layers
            stay exact, as in :class:`cgx.CompressionPolicy`.
        policy: per-layer settings instead of bits / bucket_size.
        outer_lr, outer_momentum, nesterov: the outer SGD on the global copy.
        overlap: 0 waits for each sync at once; k >= 1 applies it k inner steps later
            (by time: at the first inner step from the k-th on at which it has completed,
            waiting only where the fragment's next sync is due first).
        mix: with overlap, the fragment's local weights become
            ``mix * local + (1 - mix) * new_global`` (without overlap: the new global).
        error_feedback: keep what quantization dropped per parameter and add it to the
            next outer gradient.
        top_k: sparse outer gradients (:class:`cgx.diloco.TopK`): of each chunk of a
            compressed layer's outer gradient, only the k values largest in magnitude
            travel (at `bits`), with their places; the rest stays in the residual (with
            `error_feedback`). Syncs then all-gather every replica's payload, which grows
            with the replicas; with ``TopK(shared=True)`` every replica sends the same
            places, drawn at random, in an allreduce. Measured with ``outer_lr=1.5,
            outer_momentum=0`` and ``TopK(decay=0.95)``: the residual takes the
            momentum's part (docs/diloco.md, "Sparse outer gradients").
        group: the "cgx" group the replicas sync over (default: the default group).
        membership: instead of `group`, an elastic run's :class:`cgx.elastic.Membership`:
            the replicas are the members of its current round (a round is formed here if
            none is). A sync that fails (a replica died, left or lost its link) is done
            again among the replicas of the next round, which also admits replicas
            waiting to join (the members poll at every sync and admit them together);
            a replica constructed while the run is on takes the run's state from a live
            member (docs/diloco.md, "Elastic runs").
        replica_group: in an elastic run, where a replica is a host's DDP group: that
            group. Its rank 0 (the lead) gives `membership` and syncs; the others give
            neither and take the lead's step and weights after every inner step.

    Attributes:
        step: the inner steps this replica took (the inner optimizer's step() calls).
        syncs_started: the fragment syncs started, alike on every replica at the same
            point of the schedule; by time it grows by one a sync, and the replicas' loops
            end at the same value of it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        fragments: int = 1,
        bits: int = 4,
        bucket_size: int | None = None,
        policy: CompressionPolicy | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        overlap: int = 0,
        mix: float = 0.5,
        error_feedback: bool = True,
        top_k: TopK | None = None,
        group: dist.ProcessGroup | None = None,
        fragment_pattern: str = "strided",
        membership: Membership | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._host = None if replica_group is None else ReplicaHost(replica_group, model)
        problem = None  # in a host's replica, every rank raises what one rank's arguments raise
        try:
            self._schedule = _Schedule(sync_every, fragments, fragment_pattern, outer_lr, outer_momentum, nesterov,
                                       overlap, mix, error_feedback, top_k)
            built = _checked_arguments(model, inner_optimizer, bits, bucket_size, policy, self._schedule,
                                       self._host, membership, group)
        except (TypeError, ValueError) as e:
            if self._host is None:
                raise
            problem, built = e, {}
        self._recovery: Recovery | None = None  # an elastic run's (it holds the membership)
        self._weights_changed = False  # this step (the lead tells its host)
        self.step = 0
        self.syncs_started = 0  # fragment syncs started (by time: the last one's number)
        if self._host is not None:
            self._host.agree(problem, built)
            if not self._host.is_lead:
                self._init_follower(model, inner_optimizer)
                return
        try:
            self._build(model, inner_optimizer, bits, bucket_size, policy, group, membership)
        except BaseException:
            self._tell_host(FAILED)  # the host's other ranks wait for the lead's first word
            raise
        self._tell_host(CHANGED)  # the weights it starts from, to the host's other ranks

    def _build(self, model, inner_optimizer, bits, bucket_size, policy, group, membership) -> None:
        """The constructor's work on a replica's only rank, or on its lead."""
        if membership is None:
            self._replicas = Replicas.of_group(resolve_group(group, "cgx.DiLoCo"))
        else:
            if not isinstance(membership, Membership):
                raise TypeError(f"cgx.DiLoCo: membership must be a cgx.elastic.Membership, got "
                                f"{type(membership).__name__}")
            if group is not None:
                raise ValueError("cgx.DiLoCo: give either group or membership, not both")
            membership.set_terms("diloco", _terms(self._schedule, model, bits, bucket_size, policy))
            self._recovery = Recovery(self._recoverable(), membership)
            self._replicas = self._recovery.first_replicas()
        self._model = model
        self._optimizer = inner_optimizer
        self._policy = policy or CompressionPolicy.from_settings(self._replicas.backend.settings, bits=bits,
                                                                 bucket_size=bucket_size)
        schedule = self._schedule
        self._fragments = Fragments(model, inner_optimizer, self._policy, schedule.fragments,
                                    schedule.fragment_pattern,
                                    schedule.fragments if schedule.by_time else schedule.sync_every, schedule.top_k,
                                    schedule.outer_options)
        self._in_flight: list[Sync] = []
        self._closed = False
        self._clock = SyncClock(schedule.sync_every, schedule.fragments) if schedule.by_time else None
        # By time, in an elastic run: the joiners each finished sync's rows say, by the sync's
        # number, kept until the fragment's next sync starts (below, _syncs_by_time).
        self._rows_seen: dict[int, list[int]] = {}
        self._started_at = -1  # by time: the inner step the last sync started at
        self._replicas.by_time = schedule.by_time
        if membership is None:
            self._start_together()
            self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
            return
        if self._host is not None:
            self._host.warn_if_it_waits_less(membership.group_timeout + membership.join_timeout)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        try:
            self._recovery.join()
        except BaseException:
            self._stop()  # a DiLoCo that failed to join trains nothing
            raise

    def _init_follower(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer) -> None:
        """A rank of a host's replica other than its lead: takes the lead's step, syncs
        started and weights after every inner step (replica_host.py)."""
        self._model, self._optimizer = model, inner_optimizer
        self.step, self._closed = 0, False
        self._hook = inner_optimizer.register_step_post_hook(lambda *_: self._hear_the_lead())
        self._hear_the_lead()  # the weights the lead joined the run with

    def _hear_the_lead(self, ending: bool = False) -> None:
        """A follower: the lead's word after its step (`ending`: after its close() or
        leave(), which this rank's close() or leave() meets)."""
        self.step, self.syncs_started, event = self._host.hear()
        if event in (CLOSED, FAILED, LEFT):
            self._stop()
        self._host.check_the_lead(self.step, event, ending)

    def _lead_only(self, what: str) -> None:
        if self._following:
            raise RuntimeError(f"cgx.DiLoCo.{what}: a host's replica keeps its DiLoCo state on its lead rank (rank 0 "
                               f"of replica_group), which alone saves, loads and holds it; the host's other ranks "
                               f"take the lead's step and weights after every inner step")

    def _tell_host(self, event: int) -> None:
        """The lead: its step and event to the host's other ranks (weights where changed)."""
        if self._host is not None:
            if event == UNCHANGED and self._weights_changed:
                event = CHANGED
            self._host.tell(self.step, self.syncs_started, event)
            self._weights_changed = False

    def _start_together(self) -> None:
        """The run's start: every replica starts from group rank 0's weights (ValueError
        on every rank where they built DiLoCo otherwise). A time schedule's clock starts
        as an all-gather completes: on every replica within a latency of the others."""
        self._fragments.start_together(self._replicas, _compared(self._schedule))
        self._fragments.start_intervals(self.step)
        if self._clock is not None:
            self._replicas.all_gather(torch.zeros(1))
            self._clock.anchor(self.syncs_started)

    # The hyper-parameters, as attributes (a value set is checked as the constructor's).
    sync_every = _schedule_field("sync_every")
    overlap = _schedule_field("overlap")
    mix = _schedule_field("mix")
    error_feedback = _schedule_field("error_feedback")

    @property
    def _following(self) -> bool:
        return self._host is not None and not self._host.is_lead

    @property
    def residuals(self) -> Residuals:
        """This rank's error-feedback residuals, by parameter name."""
        self._lead_only("residuals")
        return self._replicas.residuals

    @residuals.setter
    def residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        self._lead_only("residuals")
        self._replicas.residuals = Residuals(residuals)

    # ---- the schedule

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        self._then_tell_host(None, UNCHANGED)

    def _then_tell_host(self, action: Callable[[], Any] | None, event: int) -> None:
        """Runs `action` (None: this step's syncs) with recovery, then tells the host's
        other ranks `event` (or, where `action` raised, that the lead failed)."""
        try:
            if self._recovery is not None:
                self._recovery.run(action)
            else:
                (action or self._syncs_of_this_step)()
        except BaseException:
            self._tell_host(FAILED)
            raise
        self._tell_host(event)

    # ---- what recovery reads and sets (an elastic run's Recovery, recovery.py)

    def _recoverable(self) -> Recoverable:
        me = weakref.proxy(self)  # a DiLoCo dropped without close() frees at once (see Recoverable)
        return Recoverable(
            step=lambda: me.step, position=lambda: me.step if me._clock is None else me.syncs_started,
            next_sync_in=lambda: me._next_sync_in(), error_feedback=lambda: me.error_feedback,
            replicas=lambda: me._replicas, use_replicas=lambda replicas: me._use_replicas(replicas),
            in_flight=lambda: me._in_flight,
            construction=lambda: me._fragments.construction(dataclasses.asdict(me._schedule)),
            layout=lambda: {**me._fragments.layout(), "syncs_started": me.syncs_started,
                            "in_flight": [(s.key, s.due, s.agreement.trained, s.weight) for s in me._in_flight]},
            state_tensors=lambda frozen: me._fragments.state_tensors(frozen),
            take_layout=lambda layout, position, next_sync_in: me._take_layout(layout, position, next_sync_in),
            restart_local_weights=lambda: me._fragments.restart_local_weights(),
            start_together=lambda: me._start_together(), syncs_of_this_step=lambda: me._syncs_of_this_step(),
            stop=lambda: me._stop())

    def _use_replicas(self, replicas: Replicas) -> None:
        """Syncs from now on go to `replicas` (a new round's). Residuals start over: they
        belong to a rank of a round; the traffic counts go on."""
        replicas.stats, replicas.by_time = self._replicas.stats, self._replicas.by_time
        self._replicas = replicas
        self._rows_seen.clear()  # what the old round's rows said of its ranks
        self._weights_changed = True

    def _take_layout(self, layout: dict[str, Any], position: int, next_sync_in: float | None) -> None:
        """Takes another replica's layout, position (Recoverable.position), schedule and
        syncs in flight (the tensors follow). A sync in flight here that it also has keeps
        what this replica sent into it, so that it can be done again with it. By time the
        replica keeps its own step count: its syncs in flight are due at once, its next
        outer gradients hold its steps from here, and its clock takes the other's next
        deadline."""
        self._fragments.take_layout(layout)
        self.syncs_started = layout["syncs_started"]
        if self._clock is None:
            self.step = position
        self._in_flight = arrived(self._fragments.all, layout["in_flight"], self._in_flight,
                                  due=None if self._clock is None else self.step)
        self._fragments.start_intervals(self.step)  # its local weights restart from the global ones
        if self._clock is not None:
            self._clock.anchor(self.syncs_started, now=time.monotonic() + next_sync_in - self._clock.spacing)

    def _next_sync_in(self) -> float | None:
        """By time: seconds from now to the next sync's deadline (None by steps, or before
        the run's start)."""
        if self._clock is None or not self._clock.anchored:
            return None
        return self._clock.deadline(self.syncs_started + 1) - time.monotonic()

    def _stop(self) -> None:
        """Trains on without syncing (closed, left, failed, or refused by the run)."""
        self._closed = True
        self._hook.remove()

    # ---- lifetime

    def close(self) -> None:
        """Agrees with the other replicas on the inner step (by time: the sync number;
        RuntimeError on every rank where they differ), applies the syncs in flight and
        removes the hook. A second call does nothing. In an elastic run every replica
        still in it calls close() at the end, which ends the run (Membership.end_run): a
        replica that comes back to it later is told so at its next call to the rendezvous."""
        if self._closed:
            return
        if self._following:
            self._hear_the_lead(ending=True)  # the lead's close(): its last weights
            return
        self._stop()
        self._then_tell_host(self._close_together, CLOSED)
        if self._recovery is not None:
            self._recovery.end_run()

    def _close_together(self) -> None:
        agreement = self._replicas.agree_to_close(self.syncs_started if self._clock is not None else self.step)
        for sync in list(self._in_flight):
            self._finish(sync, follow=False)
        self._replicas.check(agreement)

    def leave(self) -> None:
        """An elastic run goes on without this replica: its syncs in flight are dropped and
        it leaves the membership; the others do their next sync with it again without it.
        With replica_group, every rank of the host calls it at the same point."""
        if self._following:
            if not self._closed:
                self._hear_the_lead(ending=True)
            return
        if self._recovery is None:
            raise RuntimeError("cgx.DiLoCo.leave: only a replica of an elastic run (membership=...) leaves; "
                               "a group's replicas end together with close()")
        if self._closed:
            return
        self._stop()
        self._in_flight.clear()
        self._recovery.leave()
        self._tell_host(LEFT)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # the step that raised left its state as it was; nothing more is applied
            self._stop()
            if not self._following:
                self._in_flight.clear()

    # ---- stats and checkpoints

    def stats(self) -> dict[str, Any]:
        """This rank's totals (docs/stats.md): step, outer_syncs (fragment syncs applied),
        payload_bytes (what this rank put into syncs, counted as each completes:
        compressed, or float32 where CGX_COMPRESSION_AUTO sent it exactly) against
        uncompressed_payload_bytes (float32), peak_payload_bytes (the largest single sync),
        exact_calls, exact_bytes and exact_why: the syncs sent the exact way, their payload,
        and why ('auto': CGX_COMPRESSION_AUTO timed it faster, 'policy': every layer of
        the fragment exact),
        waits (syncs not yet complete when their result was due, and every sync without
        overlap: the inner loop waited on the link), wait_seconds and in_flight. In an
        elastic run also: replicas (in the current round), rounds (this replica was in),
        replicas_lost and replicas_joined (seen from here), syncs_redone (done again
        after a failure), reform_seconds (from a failure or an admission to the next
        round's start), bytes_to_joiners (state this replica sent to replicas taking
        it: its size times their number)."""
        if self._following:
            return Stats({"step": self.step})  # the replica's stats are its lead's
        elastic = {} if self._recovery is None else {"replicas": self._replicas.size, **self._recovery.stats}
        return Stats({"step": self.step, **copy.deepcopy(self._replicas.stats), "in_flight": len(self._in_flight),
                      **elastic})

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (docs/diloco.md, "Checkpoints"): global weights, outer
        momentum, residuals, step, stats, each fragment's members, and the syncs in flight
        (waited for, their average kept). Every rank saves its own, with the model and the
        inner optimizer."""
        self._lead_only("state_dict")
        def complete() -> None:
            for sync in self._in_flight:
                sync.complete(self._replicas)
        self._recovery.run(complete) if self._recovery is not None else complete()
        return {**saved(self._replicas, self._fragments, self.step, self._in_flight),
                "syncs_started": self.syncs_started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict() into a DiLoCo built as when it was saved (the same
        fragments; a model with every parameter it syncs), ValueError naming what differs.
        Residuals load only on the rank and group size that saved them, syncs in flight
        only at that size (to resume at another: ``state["residuals"] = {}``, none in
        flight). With replica_group, on the lead only (the host's other ranks take its
        step, syncs_started and weights after the next inner step). By time, the clock
        restarts here."""
        self._lead_only("load_state_dict")
        check_state(state, self._replicas, self._fragments, self._model)
        if self._recovery is not None and self._recovery.took_state:
            raise RuntimeError("cgx.DiLoCo.load_state_dict: this replica took the state of a live member of the "
                               "elastic run when it joined; loading a checkpoint would set it apart from the others "
                               "(load checkpoints when every replica of the run starts again)")
        self.step, self._in_flight = loaded(state, self._replicas, self._fragments, self._in_flight)
        self.syncs_started = int(state.get("syncs_started", 0))  # (a state of before it: the step schedule's)
        self._started_at = -1  # (the loaded step may be one this DiLoCo started a sync at before)
        if self._clock is not None:  # the next sync falls due one spacing from now
            self._clock.anchor(self.syncs_started)


def _compared(schedule: _Schedule) -> dict[str, Any]:
    """The schedule as the replicas compare it at the start: top_k field by field (the same
    fields whether it is given or not), so that a difference names the field and both values."""
    fields = dataclasses.asdict(schedule)
    top_k = fields.pop("top_k")
    fields["top_k"] = top_k is not None
    for field in dataclasses.fields(TopK):
        fields[f"top_k.{field.name}"] = field.default if top_k is None else top_k[field.name]
    return fields


def _terms(schedule: _Schedule, model, bits, bucket_size, policy) -> dict[str, Any]:
    """What a replica joining an elastic run must share with its members, checked
    before it asks to join (Membership.set_terms): what construction fixes for the
    run. The schedule's settable fields and the trained set may change during a run:
    they are compared as the round forms (recovery.py)."""
    settable = {k for k in dataclasses.asdict(schedule) if isinstance(getattr(DiLoCo, k, None), property)}
    return {**{k: v for k, v in dataclasses.asdict(schedule).items() if k not in settable},
            "bits": bits, "bucket_size": bucket_size,
            "policy": None if policy is None else sorted(policy.resolve(model).items()),
            "parameters": [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]}


def _checked_arguments(model, optimizer, bits, bucket_size, policy, schedule: _Schedule, host: ReplicaHost | None,
                       membership, group) -> dict[str, Any]:
    """Checks the constructor's arguments (TypeError, ValueError; warns where top_k meets
    outer momentum). Returns what a host's ranks must agree on (with replica_group)."""
    _check_model_and_policy(model, optimizer, bits, bucket_size, policy)
    if schedule.top_k is not None and bits == RAW_BITS and policy is None:
        raise ValueError("cgx.DiLoCo: top_k with bits=32 (exact DiLoCo): sparse outer gradients are "
                         "quantized; give bits of 1..8")
    if schedule.top_k is not None and schedule.outer_momentum > 0:
        warnings.warn("cgx.DiLoCo: top_k with outer momentum: sparse outer gradients were measured to "
                      "train worse with it (the residual, decayed, takes its part); give outer_lr=1.5, "
                      "outer_momentum=0, nesterov=False (docs/diloco.md, 'Sparse outer gradients')",
                      stacklevel=3)  # the caller of DiLoCo(...)
    if host is None:
        return {}
    if (membership is not None) != host.is_lead or group is not None:
        raise ValueError("cgx.DiLoCo: with replica_group, the host's rank 0 (the lead) gives membership= "
                         "and the host's other ranks give neither membership nor group")
    return {**dataclasses.asdict(schedule), "bits": bits, "bucket_size": bucket_size,
            "policy": None if policy is None else sorted(policy.resolve(model).items()),
            "parameters": [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
            "trained parameters": list(synced_parameters(model, optimizer))}


def _check_model_and_policy(model, optimizer, bits, bucket_size, policy) -> None:
    what = "cgx.DiLoCo"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: inner_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if policy is not None:
        if not isinstance(policy, CompressionPolicy):
            raise TypeError(f"{what}: policy must be a cgx.CompressionPolicy, got {type(policy).__name__}")
        if bits != 4 or bucket_size is not None:
            raise ValueError(f"{what}: give either policy or bits / bucket_size, not both")
    check_bits(bits, what)
    if bucket_size is not None:
        check_bucket_size(bucket_size, what)
