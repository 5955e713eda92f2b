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

import dataclasses
import logging
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from cgx.agreement import first_difference
from cgx.backend import resolve_group
from cgx.counters import RENAMED, Stats
from cgx.diloco.outer_sync import (_CLOSE, _ROW, _SYNC, _Agreement, _assign, _current_rows, _Fragment, _layers,
                                   _local, _Member, _member, _Replicas, _restore, _Schedule, _Sync,
                                   _synced_parameters, _trained)
from cgx.diloco.recovery import Recovery
from cgx.diloco.replica_host import CHANGED, CLOSED, FAILED, LEFT, UNCHANGED, ReplicaHost
from cgx.diloco.sparse import TopK
from cgx.elastic import Membership
from cgx.layers import RAW_BITS, CompressionPolicy, LayerSetting, check_bits, check_bucket_size
from cgx.residuals import Residuals, check_same_place

__all__ = ["DiLoCo"]

_log = logging.getLogger("cgx.diloco")

_STATE_KEYS = ("rank", "world_size", "fragments", "joining", "leaving", "step", "global_weights", "outer_momentum",
               "residuals", "in_flight", "stats")

def _schedule_field(name: str) -> property:
    """DiLoCo's attribute for the hyper-parameter `name` of its _Schedule."""
    def set_field(self, value: Any) -> None:
        schedule = dataclasses.replace(self._schedule, **{name: value})
        # The fragments keep their offsets (a sync in flight is never moved): one at or
        # above sync_every would never sync again.
        stranded = [f for f in self._fragments if f.offset >= schedule.sync_every]
        if stranded:
            raise ValueError(f"cgx.DiLoCo: sync_every={schedule.sync_every} leaves fragment(s) "
                             f"{[f.index for f in stranded]} (offsets {[f.offset for f in stranded]}, fixed at "
                             f"construction) without a step to sync at; sync_every must stay above "
                             f"{max(f.offset for f in self._fragments)}")
        self._schedule = schedule
    return property(lambda self: getattr(self._schedule, name), set_field)


class DiLoCo:
    """Streaming DiLoCo on the inner optimizer of `model`.

    Args:
        model: the replica's model (plain, DDP- or FSDP2-wrapped); its parameters that
            `inner_optimizer` updates are synchronized, named as ``named_parameters()``.
            That set follows the optimizer: parameters that start or stop being trained
            (param groups added, layers (un)frozen) join or leave it at the next sync.
        inner_optimizer: the optimizer the training loop steps; DiLoCo hooks its steps.
        sync_every: inner steps between two syncs of a parameter (H).
        fragments: groups of whole layers that sync at staggered steps (P); fragment p
            syncs at the steps t > 0 with ``t % sync_every == p * sync_every // fragments``.
        fragment_pattern: "strided" (layers in model order each go to the fragment with
            the fewest elements so far, ties to the next in turn: layer i to fragment
            i mod P where layers are alike) or "sequential" (runs of consecutive layers
            of about 1/P of the elements each).
        bits, bucket_size: how outer gradients travel (1..8 bits, or 32 for exact
            DiLoCo; the bucket size and the scheme are the group's). 1-D and small layers
            stay exact, as in :class:`cgx.CompressionPolicy`.
        policy: per-layer settings instead of bits / bucket_size.
        outer_lr, outer_momentum, nesterov: the outer SGD on the global copy.
        overlap: 0 waits for each sync at once; k >= 1 applies it k inner steps later.
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
            _check_model_and_policy(model, inner_optimizer, bits, bucket_size, policy)
            self._schedule = _Schedule(sync_every, fragments, fragment_pattern, outer_lr, outer_momentum, nesterov,
                                       overlap, mix, error_feedback, top_k)
            if top_k is not None and bits == RAW_BITS and policy is None:
                raise ValueError("cgx.DiLoCo: top_k with bits=32 (exact DiLoCo): sparse outer gradients are "
                                 "quantized; give bits of 1..8")
            if top_k is not None and outer_momentum > 0:
                warnings.warn("cgx.DiLoCo: top_k with outer momentum: sparse outer gradients were measured to "
                              "train worse with it (the residual, decayed, takes its part); give outer_lr=1.5, "
                              "outer_momentum=0, nesterov=False (docs/diloco.md, 'Sparse outer gradients')",
                              stacklevel=2)
            if self._host is not None and ((membership is not None) != self._host.is_lead or group is not None):
                raise ValueError("cgx.DiLoCo: with replica_group, the host's rank 0 (the lead) gives membership= "
                                 "and the host's other ranks give neither membership nor group")
            built = {} if self._host is None else {  # what the host's ranks must agree on
                **dataclasses.asdict(self._schedule), "bits": bits, "bucket_size": bucket_size,
                "policy": None if policy is None else sorted(policy.resolve(model).items()),
                "parameters": [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
                "trained parameters": list(_synced_parameters(model, inner_optimizer))}
        except (TypeError, ValueError) as e:
            if self._host is None:
                raise
            problem, built = e, {}
        self._recovery: Recovery | None = None  # an elastic run's (it holds the membership)
        self._weights_changed = False  # this step (the lead tells its host)
        self.step = 0
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
            self._replicas = _Replicas.of_group(resolve_group(group, "cgx.DiLoCo"))
        else:
            if not isinstance(membership, Membership):
                raise TypeError(f"cgx.DiLoCo: membership must be a cgx.elastic.Membership, got "
                                f"{type(membership).__name__}")
            if group is not None:
                raise ValueError("cgx.DiLoCo: give either group or membership, not both")
            membership.set_terms("diloco", self._terms(model, bits, bucket_size, policy))
            self._recovery = Recovery(self, membership)
            self._replicas = self._recovery.first_replicas()
        self._model = model
        self._optimizer = inner_optimizer
        self._policy = policy or CompressionPolicy.from_settings(self._replicas.backend.settings, bits=bits,
                                                                 bucket_size=bucket_size)
        self._fragments = self._initial_fragments()
        self._in_flight: list[_Sync] = []
        self._joining: dict[str, tuple[int, _Member]] = {}  # name -> (fragment, member): joins at its start
        self._leaving: set[str] = set()  # members that leave when their fragment's sync next starts
        self._closed = False
        if membership is None:
            self._start_together()
            self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
            return
        if self._host is not None:
            self._warn_if_the_host_waits_less(membership)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        try:
            self._recovery.join()
        except BaseException:
            self._closed = True
            self._hook.remove()  # a DiLoCo that failed to join trains nothing
            raise

    def _terms(self, model, bits, bucket_size, policy) -> dict[str, Any]:
        """What a replica joining an elastic run must share with its members, checked
        before it asks to join (Membership.set_terms): what construction fixes for the
        run. The schedule's settable fields and the trained set may change during a run:
        they are compared as the round forms (recovery.py)."""
        settable = {k for k in dataclasses.asdict(self._schedule) if isinstance(getattr(DiLoCo, k, None), property)}
        return {**{k: v for k, v in dataclasses.asdict(self._schedule).items() if k not in settable},
                "bits": bits, "bucket_size": bucket_size,
                "policy": None if policy is None else sorted(policy.resolve(model).items()),
                "parameters": [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]}

    def _warn_if_the_host_waits_less(self, membership: Membership) -> None:
        """A follower waits for its lead as long as the host group's timeout; a lead can
        spend a group timeout finding a replica dead, then a join timeout forming the next
        round. A host group that gives up sooner ends a healthy host."""
        needed = membership.group_timeout + membership.join_timeout
        timeout = self._host.timeout()
        if timeout is not None and timeout < needed:
            _log.warning("cgx.DiLoCo: replica_group's timeout (%s) is shorter than the lead may take to re-form "
                         "the run (group_timeout + join_timeout = %s): the host's other ranks may give up on a "
                         "healthy lead; create the host's group with timeout=%s or more", timeout, needed, needed)

    def _init_follower(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer) -> None:
        """A rank of a host's replica other than its lead: takes the lead's step and
        weights after every inner step (replica_host.py)."""
        self._model, self._optimizer = model, inner_optimizer
        self.step, self._closed = 0, False
        self._hook = inner_optimizer.register_step_post_hook(lambda *_: self._hear_the_lead())
        self._hear_the_lead()  # the weights the lead joined the run with

    def _hear_the_lead(self, ending: bool = False) -> None:
        """A follower: the lead's word after its step (`ending`: after its close() or
        leave(), which this rank's close() or leave() meets)."""
        step, event = self._host.hear()
        self.step = step
        if event in (CLOSED, FAILED, LEFT):
            self._closed = True
            self._hook.remove()
        lead = "this replica's lead rank (rank 0 of replica_group)"
        if event == FAILED or (event == LEFT and not ending):
            raise RuntimeError(f"cgx.DiLoCo: {lead} {'failed: see its error' if event == FAILED else 'left the run'}"
                               f", at inner step {step}")
        if ending and event not in (CLOSED, LEFT):
            raise RuntimeError(f"cgx.DiLoCo: {lead} took inner step {step} where this rank ended: every rank of a "
                               f"host calls close() (or leave()) at the same point")

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
            self._host.tell(self.step, event)
            self._weights_changed = False

    def _start_together(self) -> None:
        """The run's start: the replicas agree on how they built DiLoCo, and every one
        starts from group rank 0's weights, frozen ones too, as DDP does."""
        self._agree_on_construction()
        self._replicas.broadcast([p for _, p in self._model.named_parameters()])
        with torch.no_grad():
            for fragment in self._fragments:
                for m in fragment.members:
                    m.global_weight.copy_(_local(m.param))

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

    def _initial_fragments(self) -> list[_Fragment]:
        """The fragments of the parameters the inner optimizer trains, whole layers each."""
        schedule = self._schedule
        params = _synced_parameters(self._model, self._optimizer)
        # Against all the model's layers: frozen ones may join later, into empty fragments.
        layers = _layers(dict(self._model.named_parameters()))
        if schedule.fragments > len(layers):
            raise ValueError(f"cgx.DiLoCo: fragments={schedule.fragments} is more than the model's "
                             f"{len(layers)} layers with parameters")
        settings = self._policy.resolve(self._model)
        assignment = _assign(params, _layers(params), schedule.fragments, schedule.fragment_pattern)
        fragments = [_Fragment(p, p * schedule.sync_every // schedule.fragments, schedule.top_k)
                     for p in range(schedule.fragments)]
        for fragment, names in zip(fragments, assignment):
            fragment.set_members([_member(n, params[n], settings[n]) for n in names], schedule.outer_options)
        if schedule.top_k is not None:
            largest = max(sum(numel for _, _, numel in f.compressed) for f in fragments)
            if largest == 0:
                raise ValueError("cgx.DiLoCo: top_k with no compressed layer (the policy keeps every layer exact): "
                                 "sparse outer gradients are for compressed layers; leave top_k=None")
            if schedule.top_k.chunk > largest:
                raise ValueError(f"cgx.DiLoCo: top_k's chunk={schedule.top_k.chunk} is larger than every fragment's "
                                 f"compressed values (at most {largest}): each layer would be one chunk; choose a "
                                 f"chunk of at most {largest}")
        return fragments

    def _agree_on_construction(self) -> None:
        """ValueError on every rank where the replicas built DiLoCo otherwise."""
        difference = first_difference(None, all_gather=self._replicas.all_gather, fields={
            **dataclasses.asdict(self._schedule),
            "fragments and layouts": [(f.names, f.layout) for f in self._fragments],
            "parameters": [(n, tuple(p.shape), p.dtype) for n, p in self._model.named_parameters()],
        })
        if difference:
            raise ValueError(f"cgx.DiLoCo: the ranks of the group were given different settings: "
                             f"{difference}; every replica must build DiLoCo alike on the same model")

    # ---- the schedule

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        self._then_tell_host(self._syncs_of_this_step, UNCHANGED)

    def _then_tell_host(self, action: Callable[[], Any], event: int) -> None:
        """Runs `action` with recovery, then tells the host's other ranks `event` (or,
        where `action` raised, that the lead failed)."""
        try:
            self._with_recovery(action)
        except BaseException:
            self._tell_host(FAILED)
            raise
        self._tell_host(event)

    def _with_recovery(self, action: Callable[[], Any]) -> Any:
        """Runs `action`; in an elastic run, with recovery (Recovery.run)."""
        return action() if self._recovery is None else self._recovery.run(action)

    def _syncs_of_this_step(self) -> None:
        """Finishes the syncs due at this step and starts the one whose turn it is. Run
        again after the replicas re-formed (Recovery.run), it does what is left: an
        applied sync has left the in-flight list, and a fragment's sync starts once."""
        joining = []
        for sync in [s for s in self._in_flight if s.due == self.step]:
            joining.append(self._finish(sync))
        for fragment in self._fragments:
            if self.step % self.sync_every == fragment.offset and fragment.last_start != self.step:
                self._change_members(fragment)
                trained, strangers = _trained(self._model, self._optimizer)
                joiners, scale = 0, None
                if self._recovery is not None:
                    joiners = self._recovery.joining(self._replicas.size)
                    scale = self._recovery.contribution(self.step)
                sync = fragment.start(self._replicas, self.step, self.step + self.overlap, self.error_feedback,
                                      trained, strangers, joiners, keep=self._recovery is not None, scale=scale)
                self._in_flight.append(sync)
                fragment.last_start = self.step
                if self.overlap == 0:
                    joining.append(self._finish(sync))
        if self._recovery is not None:
            self._recovery.admit(joining)

    def _finish(self, sync: _Sync, follow: bool = True) -> list[int]:
        """Waits for the sync's allreduce, checks the agreement it carried, then applies it;
        with `follow`, then makes the synced set follow the trained set the replicas agreed
        on. A failed allreduce or agreement raises here and changes nothing (on a group its
        sync is dropped; in an elastic run it stays in flight, to be done again). Returns
        what each replica's row says of joiners (Recovery.joining; empty where the
        agreement was checked before)."""
        if self._recovery is None:
            self._in_flight.remove(sync)
        stats = self._replicas.stats
        started = time.perf_counter()
        waits = sync.work is not None and (self.overlap == 0 or not sync.work.is_completed())
        joiners: list[int] = []
        # The agreement first: beside an exact sync it is a call of its own, and where the
        # replicas are out of step the exact sync's Gloo call has no partner to wait for.
        if not sync.checked:
            self._replicas.check(sync.agreement)
            sync.checked = True
            joiners = [int(v) for v in sync.agreement.rows[:, 2].tolist()]
        if sync.outer_gradient is not None and sync.work is not None:
            stats["waits"] += waits  # without overlap the step always waits
            sync.fragment.complete(sync, self._replicas)
            stats["wait_seconds"] += time.perf_counter() - started
        if self._recovery is not None:
            self._in_flight.remove(sync)
        self._weights_changed = True
        if sync.outer_gradient is not None:
            sync.fragment.apply(sync, self._replicas, self.overlap, self.mix)
        if follow:
            self._follow(sync.agreement.trained)
        return joiners

    # ---- what is synced follows what the optimizer trains

    def _follow(self, trained: list[tuple[str, tuple[int, ...]]]) -> None:
        """Makes the synced set follow `trained`, which every replica agreed on: members
        no longer trained leave when their fragment's sync next starts, and newly trained
        parameters start from group rank 0's values now and join a fragment when its
        sync next starts."""
        wanted = {name for name, _ in trained}
        members = {m.name for f in self._fragments for m in f.members}
        self._leaving = members - wanted
        for name in [n for n in self._joining if n not in wanted]:
            _restore(self._joining.pop(name)[1])
        new = [name for name, _ in trained if name not in members and name not in self._joining]
        if not new:
            return
        params = dict(self._model.named_parameters())
        self._replicas.broadcast([params[n] for n in new])
        for names in _layers({n: params[n] for n in new}).values():
            fragment = self._fragment_for(names[0])
            for name in names:
                self._joining[name] = (fragment, self._member(name, params[name]))

    def _fragment_for(self, name: str) -> int:
        """Where a newly trained parameter goes: to its layer's fragment where another of
        the layer's parameters is synced, else to the fragment with the fewest elements
        (the lowest index on a tie); from what every replica agreed, so alike on all."""
        layer = name.rpartition(".")[0]
        planned = [(f.index, m.name, m.param.numel()) for f in self._fragments for m in f.members
                   if m.name not in self._leaving]
        planned += [(index, n, m.param.numel()) for n, (index, m) in self._joining.items()]
        for index, other, _ in planned:
            if other.rpartition(".")[0] == layer:
                return index
        load = [0] * len(self._fragments)
        for index, _, numel in planned:
            load[index] += numel
        return min(range(len(load)), key=lambda index: (load[index], index))

    def _change_members(self, fragment: _Fragment) -> None:
        """Applies the fragment's pending joins and leaves at its sync's start."""
        leaving = {m.name for m in fragment.members if m.name in self._leaving}
        joining = [m for index, m in self._joining.values() if index == fragment.index]
        if not leaving and not joining:
            return
        self._weights_changed = True  # leaving members take their global weights
        self._leaving -= leaving
        for m in joining:
            del self._joining[m.name]
        fragment.change_members(leaving, joining, self._schedule.outer_options, self._replicas.residuals)

    def _member(self, name: str, param: torch.Tensor) -> _Member:
        return _member(name, param, self._member_setting(name, param))

    def _member_setting(self, name: str, param: torch.Tensor) -> LayerSetting:
        return self._policy.setting_for(name, self._model.get_submodule(name.rpartition(".")[0]), param)

    # ---- what recovery reads and sets (an elastic run's Recovery, recovery.py)

    def _use_replicas(self, replicas: _Replicas) -> _Replicas:
        """Syncs from now on go to `replicas` (a new round's). Residuals start over: they
        belong to a rank of a round; the traffic counts go on."""
        replicas.stats = self._replicas.stats
        self._replicas = replicas
        self._weights_changed = True
        return replicas

    def _stop(self) -> None:
        """Trains on without syncing: this replica was refused by the run."""
        self._closed = True
        self._hook.remove()

    def _layout(self) -> dict[str, Any]:
        """The run's state but its tensors: what a replica taking it needs."""
        return {
            "fragments": [f.names for f in self._fragments],
            "offsets": [f.offset for f in self._fragments],  # fixed at construction (sync_every may change)
            "syncs": [f.syncs for f in self._fragments],
            "last_start": [f.last_start for f in self._fragments],
            "momentum": [sorted(f.outer_momentum()) if f.outer is not None else [] for f in self._fragments],
            # In the order members join a fragment (model order, as _follow adds them).
            "joining": [(name, index) for name, (index, _) in self._joining.items()],
            "leaving": sorted(self._leaving),
            "in_flight": [(s.key, s.agreement.trained) for s in self._in_flight],
            "frozen": self._frozen(),
        }

    def _frozen(self) -> list[str]:
        """The parameters neither synced nor trained here: equal on every replica."""
        synced = {m.name for f in self._fragments for m in f.members} | set(self._joining)
        synced |= {name for name, _ in _trained(self._model, self._optimizer)[0]}
        return [name for name, _ in self._model.named_parameters() if name not in synced]

    def _state_tensors(self, frozen: list[str]) -> list[torch.Tensor]:
        """The run's state that a replica taking it receives, in an order every replica
        with the same layout shares: global weights, outer momentum buffers, and the
        `frozen` parameters (the reference's list)."""
        members = [m for f in self._fragments for m in f.members]
        members += [self._joining[name][1] for name in sorted(self._joining)]
        momentum = [f.outer.state[m.global_weight]["momentum_buffer"] for f in self._fragments for m in f.members
                    if f.outer is not None and f.outer.state[m.global_weight].get("momentum_buffer") is not None]
        params = dict(self._model.named_parameters())
        return [m.global_weight for m in members] + momentum + [params[name] for name in frozen]

    def _take_layout(self, layout: dict[str, Any], step: int) -> None:
        """Takes another replica's layout (its _layout()), step, schedule and syncs in
        flight (the tensors follow, _state_tensors' order). A sync in flight here that it
        also has keeps what this replica sent into it, so that it can be done again with it."""
        params = dict(self._model.named_parameters())
        mine = {s.key: s for s in self._in_flight}
        with torch.no_grad():
            for fragment, names, offset, syncs, last_start, momentum in zip(
                    self._fragments, layout["fragments"], layout["offsets"], layout["syncs"], layout["last_start"],
                    layout["momentum"]):
                fragment.set_members([self._member(n, params[n]) for n in names], self._schedule.outer_options,
                                     momentum={})
                fragment.offset, fragment.syncs, fragment.last_start = offset, syncs, last_start
                for m in fragment.members:
                    if m.name in momentum:
                        fragment.outer.state[m.global_weight] = {"momentum_buffer": torch.zeros_like(m.global_weight)}
            self._joining = {name: (index, self._member(name, params[name])) for name, index in layout["joining"]}
        self._leaving = set(layout["leaving"])
        self.step = step
        self._in_flight = []
        for key, trained in layout["in_flight"]:
            index, start, due = key
            fragment = self._fragments[index]
            own = mine.get(tuple(key))
            sent = own.sent if own is not None and own.sent is not None and own.sent.numel() == fragment.numel else None
            device = fragment.members[0].global_weight.device if fragment.members else torch.device("cpu")
            gradient = torch.zeros(fragment.numel, device=device) if fragment.members else None
            agreement = _Agreement(_SYNC, start, trained, torch.zeros(1, _ROW), None)
            self._in_flight.append(_Sync(fragment, due, agreement, gradient, None, None, sent, checked=True))

    def _restart_local_weights(self) -> None:
        with torch.no_grad():
            for m in [m for f in self._fragments for m in f.members] + [m for _, m in self._joining.values()]:
                _local(m.param).copy_(m.global_weight)

    # ---- lifetime

    def close(self) -> None:
        """Agrees with the other replicas on the inner step (RuntimeError on every rank
        where they differ), applies the syncs still in flight and removes the hook from
        the optimizer. A second call does nothing. In an elastic run every replica still
        in it calls close() at the run's end (one that leaves before: :meth:`leave`)."""
        if self._closed:
            return
        if self._following:
            self._hear_the_lead(ending=True)  # the lead's close(): its last weights
            return
        self._closed = True
        self._hook.remove()
        self._then_tell_host(self._close_together, CLOSED)

    def _close_together(self) -> None:
        replicas = self._replicas
        agreement = replicas.agree(_CLOSE, self.step, [], replicas.rows(_CLOSE, self.step, [], 0, torch.device("cpu")))
        for sync in list(self._in_flight):
            self._finish(sync, follow=False)
        replicas.check(agreement)

    def leave(self) -> None:
        """An elastic run goes on without this replica from now: its syncs in flight are
        dropped and it leaves the membership (Membership.close()); the others find it
        gone at their next collective with it and do that sync again without it. With
        replica_group, every rank of the host calls it at the same point (the lead
        leaves, the others end with its last step)."""
        if self._following:
            if not self._closed:
                self._hear_the_lead(ending=True)
            return
        if self._recovery is None:
            raise RuntimeError("cgx.DiLoCo.leave: only a replica of an elastic run (membership=...) leaves; "
                               "a group's replicas end together with close()")
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        self._in_flight.clear()
        self._recovery.leave()
        self._tell_host(LEFT)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # the step that raised left its state as it was; nothing more is applied
            self._closed = True
            self._hook.remove()
            if not self._following:
                self._in_flight.clear()

    # ---- stats and checkpoints

    def stats(self) -> dict[str, Any]:
        """This rank's totals (docs/stats.md): step, outer_syncs (fragment syncs applied),
        payload_bytes (what this rank put into syncs, counted as each completes:
        compressed, or float32 where CGX_COMPRESSION_AUTO sent it exactly) against
        uncompressed_payload_bytes (float32), peak_payload_bytes (the largest single sync),
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
        return Stats({"step": self.step, **self._replicas.stats, "in_flight": len(self._in_flight), **elastic})

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: global weights, outer momentum, residuals, step, stats, which
        parameters each fragment syncs (and those about to join or leave), and the syncs in
        flight (waited for, their averaged outer gradient kept, to be applied at their step
        after a resume). Checkpoint it with the model and the inner optimizer; every rank
        saves its own (residuals differ between ranks)."""
        self._lead_only("state_dict")
        self._with_recovery(self._complete_in_flight)
        members = [m for f in self._fragments for m in f.members] + [m for _, m in self._joining.values()]
        return {
            **self._replicas.place(),
            "fragments": [f.names for f in self._fragments],
            "joining": {name: index for name, (index, _) in self._joining.items()},
            "leaving": sorted(self._leaving),
            "step": self.step,
            "global_weights": {m.name: m.global_weight.clone() for m in members},
            "outer_momentum": {name: buffer for f in self._fragments for name, buffer in f.outer_momentum().items()},
            "residuals": self._replicas.residuals.cloned(),
            "in_flight": [{"fragment": s.fragment.index, "due": s.due,
                           "outer_gradient": None if s.outer_gradient is None else s.outer_gradient.clone(),
                           "residual": None if s.residual is None else s.residual.clone(),
                           "drift": None if s.drift is None else s.drift.clone(),
                           "step": s.agreement.step, "trained": s.agreement.trained,
                           "agreement": s.agreement.rows.clone()}
                          for s in self._in_flight],
            "stats": dict(self._replicas.stats),
            "syncs": [f.syncs for f in self._fragments],
        }

    def _complete_in_flight(self) -> None:
        for sync in self._in_flight:
            sync.fragment.complete(sync, self._replicas)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict() into a DiLoCo with the same number of fragments,
        on a model that has every parameter the state syncs (build the model and its
        optimizer's param groups as when it was saved); the state's members of each
        fragment, and the joins and leaves pending, replace this DiLoCo's. ValueError naming
        what differs otherwise. Residuals load only on the rank and group size that saved
        them, syncs in flight only at that group size: to resume at another size, load with
        ``state["residuals"] = {}`` and no sync in flight. With replica_group, on the lead
        only: the host's other ranks take its step and weights after the next inner step."""
        self._lead_only("load_state_dict")
        self._check_state(state)
        if self._recovery is not None and self._recovery.took_state:
            raise RuntimeError("cgx.DiLoCo.load_state_dict: this replica took the state of a live member of the "
                               "elastic run when it joined; loading a checkpoint would set it apart from the others "
                               "(load checkpoints when every replica of the run starts again)")
        params = dict(self._model.named_parameters())
        for sync in self._in_flight:  # the replaced run's syncs: completed, not applied
            self._replicas.wait(sync.agreement)
            if sync.work is not None:
                sync.work.wait()

        def member(name: str) -> _Member:
            m = self._member(name, params[name])
            m.global_weight.copy_(state["global_weights"][name])
            return m

        with torch.no_grad():
            for fragment, names in zip(self._fragments, state["fragments"]):
                fragment.set_members([member(n) for n in names], self._schedule.outer_options,
                                     momentum=state["outer_momentum"])
            self._joining = {name: (index, member(name)) for name, index in state["joining"].items()}
        self._leaving = set(state["leaving"])
        self._replicas.residuals = Residuals({n: r.clone() for n, r in state["residuals"].items()})
        self.step = int(state["step"])
        self._replicas.stats = {RENAMED.get(k, k): v for k, v in state["stats"].items()}  # older names too
        for fragment, syncs in zip(self._fragments, state.get("syncs", [0] * len(self._fragments))):
            fragment.syncs = syncs
        self._in_flight = [
            _Sync(self._fragments[s["fragment"]], s["due"],
                  _Agreement(_SYNC, s["step"], s["trained"], _current_rows(s["agreement"]), None),
                  None if s["outer_gradient"] is None else s["outer_gradient"].clone(),
                  None if s["residual"] is None else s["residual"].clone(), None,
                  drift=None if s.get("drift") is None else s["drift"].clone())
            for s in state["in_flight"]
        ]

    def _check_state(self, state: dict[str, Any]) -> None:
        """ValueError naming what in `state` does not fit this DiLoCo, its model or place."""
        what = "cgx.DiLoCo.load_state_dict"
        replicas = self._replicas
        missing = [k for k in _STATE_KEYS if k not in (state if isinstance(state, dict) else {})]
        if missing:
            raise ValueError(f"{what}: missing {missing} (expected the dict of DiLoCo.state_dict())")
        if len(state["fragments"]) != len(self._fragments):
            raise ValueError(f"{what}: the state has {len(state['fragments'])} fragments, this DiLoCo "
                             f"{len(self._fragments)}")
        if state["residuals"] or any(s["residual"] is not None for s in state["in_flight"]):
            check_same_place(state, replicas.place(), what)
        if state["in_flight"] and state["world_size"] != replicas.size:
            raise ValueError(f"{what}: the state has syncs in flight of a group of {state['world_size']} ranks, "
                             f"loaded in one of {replicas.size}")
        params = dict(self._model.named_parameters())
        synced = [n for names in state["fragments"] for n in names] + list(state["joining"])
        for name in synced:
            if name not in params:
                raise ValueError(f"{what}: the state syncs {name!r}, a parameter this model does not have: build "
                                 f"the model (and add its optimizer's param groups) as when the state was saved")
        for key in ("global_weights", "outer_momentum", "residuals"):
            for name, tensor in state[key].items():
                local = _local(params[name]) if name in synced else None
                if local is None or tensor.shape != ((local.numel(),) if key == "residuals" else local.shape):
                    raise ValueError(f"{what}: {key}[{name!r}] does not fit this model's parameter "
                                     f"(a checkpoint of another model or shard)")
        if set(state["global_weights"]) != set(synced):
            raise ValueError(f"{what}: global_weights lacks {sorted(set(synced) - set(state['global_weights']))}")


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
