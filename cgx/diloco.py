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
import hashlib
import logging
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from cgx import _C
from cgx.agreement import first_difference
from cgx.backend import exact, get_backend, resolve_group
from cgx.config import check_int
from cgx.counters import Stats
from cgx.elastic import Membership, Round
from cgx.errors import CallMismatchError, CollectiveTimeoutError, MembershipError, PeerError
from cgx.layers import (RAW, CompressionPolicy, LayerSetting, Segment, all_raw, append_segment, check_bits,
                        check_bucket_size, layout_bytes)
from cgx.replica_host import CHANGED, CLOSED, FAILED, LEFT, UNCHANGED, ReplicaHost, move_by_dtype
from cgx.residuals import Residuals, check_same_place, place

__all__ = ["DiLoCo"]

_log = logging.getLogger("cgx.diloco")

_PATTERNS = ("strided", "sequential")

# The replicas' agreement rides on each sync: its buffer ends with a raw (exact) row per
# rank, each rank filling its own and zeros elsewhere, so after the average every rank holds
# every rank's row over the group size (multiplied back and rounded: exact). A row: what
# the call is for, the tensors the optimizer holds that are not the model's, the inner step
# and a digest of the trained parameters, these two in 16-bit pieces (float32 carries them
# exactly). close(), a fragment without members and an exact (Gloo) sync, whose sums a
# longer buffer would order otherwise, send the rows alone. In an elastic run a row also
# says whether this replica saw replicas waiting to join: the members admit them together.
_SYNC, _CLOSE = 0, 1
_STEP_PIECES, _DIGEST_PIECES = 3, 4
_HEAD = 3  # kind, strangers, joiners
_ROW = _HEAD + _STEP_PIECES + _DIGEST_PIECES
_OUT_OF_STEP = ("every replica must call the inner optimizer's step() alike: DiLoCo counts those calls, and "
                "GradScaler skips step() on a replica whose gradients have Inf/NaN (make the replicas skip together)")

# stats() keys renamed when the front-ends took one vocabulary (old -> new; docs/stats.md).
_RENAMED = {"bytes_sent": "payload_bytes", "bytes_uncompressed": "uncompressed_payload_bytes",
            "peak_bytes": "peak_payload_bytes"}


@dataclass(frozen=True)
class _Schedule:
    """The hyper-parameters every replica must share (compared over the group at
    construction, in this order), checked."""

    sync_every: int
    fragments: int
    fragment_pattern: str
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    overlap: int
    mix: float
    error_feedback: bool

    def __post_init__(self) -> None:
        what = "cgx.DiLoCo"
        check_int(self.sync_every, "sync_every", what, low=1)
        check_int(self.fragments, "fragments", what, low=1)
        check_int(self.overlap, "overlap", what)
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
        if self.fragment_pattern not in _PATTERNS:
            raise ValueError(f"{what}: fragment_pattern must be one of {_PATTERNS}, got {self.fragment_pattern!r}")
        # As every replica compares them: numbers as floats, switches as bools.
        for name, kind in (("outer_lr", float), ("outer_momentum", float), ("mix", float), ("nesterov", bool),
                           ("error_feedback", bool)):
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def outer_options(self) -> dict[str, Any]:
        """The outer SGD's arguments."""
        return {"lr": self.outer_lr, "momentum": self.outer_momentum, "nesterov": self.nesterov}


@dataclass(eq=False)  # compared by identity: they hold tensors
class _Member:
    """A synced parameter."""

    name: str
    param: torch.Tensor  # the replica's parameter (a DTensor under FSDP2)
    global_weight: torch.Tensor  # float32, the local shape (the shard under FSDP2)
    setting: LayerSetting


@dataclass(eq=False)
class _Agreement:
    """What this rank said at a sync's start or at close(), and every rank's rows."""

    kind: int  # _SYNC or _CLOSE
    step: int
    trained: list[tuple[str, tuple[int, ...]]]  # (name, shape) of what the optimizer trains, model order
    rows: torch.Tensor  # (group size, _ROW) float32: every rank's row once `work` completed
    work: Any  # the call carrying the rows (the sync's, or theirs alone); None once done and they are decoded


@dataclass(eq=False)
class _Sync:
    """A fragment's sync, from its start to the step its result is applied."""

    fragment: _Fragment
    due: int  # the step after which it is applied
    agreement: _Agreement
    outer_gradient: torch.Tensor | None  # flat float32, the average once the work completed; None: no members
    residual: torch.Tensor | None  # this rank's error feedback, updated by the collective
    work: Any  # the allreduce's Work (the agreement's too, but beside an exact sync); None once it completed
    sent: torch.Tensor | None = None  # elastic runs: a copy of what this rank put in, to do the sync again
    checked: bool = False  # the agreement was checked (a sync completed before its replicas re-formed)

    @property
    def completed(self) -> bool:
        return self.work is None and self.agreement.work is None

    @property
    def key(self) -> tuple[int, int, int]:
        """(fragment, start step, due step): the sync, alike on every replica."""
        return self.fragment.index, self.agreement.step, self.due


class _Replicas:
    """The replicas as one rank sees them: the cgx backend they sync over (a group's, or
    an elastic run's round's), this rank's residuals and traffic, and the agreement every
    sync carries. Every collective goes to the backend itself, so that a round, which
    has no torch ProcessGroup, works as a group does."""

    def __init__(self, backend: _C.ProcessGroupCGX, rank: int, size: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.group = group  # None in an elastic run's round
        self.backend = backend
        self.rank, self.size = rank, size
        self.skip_incomplete = self.backend.settings.skip_incomplete_buckets
        self.residuals = Residuals()
        self.stats = {"outer_syncs": 0, "payload_bytes": 0, "uncompressed_payload_bytes": 0,
                      "peak_payload_bytes": 0, "waits": 0, "wait_seconds": 0.0}

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> _Replicas:
        return cls(get_backend(group), dist.get_rank(group), group.size(), group)  # ValueError: not cgx's

    @classmethod
    def of_round(cls, round_: Round) -> _Replicas:
        return cls(round_.backend, round_.rank, round_.size)

    def place(self) -> dict[str, Any]:
        """Where this rank's residuals belong (a checkpoint's "rank", "world_size" and
        "global_rank"; a round has no global rank)."""
        if self.group is not None:
            return place(self.group)
        return {"rank": self.rank, "world_size": self.size, "global_rank": None}

    def send(self, tensors: list[torch.Tensor], root: int, to: list[int]) -> int:
        """The ranks in `to` take group rank `root`'s values of the tensors (point to
        point, one message per dtype and receiver; the other ranks do nothing). Returns
        the bytes `root` sent."""
        if self.rank != root and self.rank not in to:
            return 0

        def move(flat: torch.Tensor) -> None:
            if self.rank == root:
                for work in [self.backend.send([flat], peer, 0) for peer in to]:
                    _wait(work)
            else:
                _wait(self.backend.recv([flat], root, 0))
        moved = move_by_dtype([_local(t) for t in tensors], move)
        return moved * len(to) if self.rank == root else 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (one shape on all), in rank order."""
        everyone = [[torch.empty_like(tensor) for _ in range(self.size)]]
        _wait(self.backend.allgather(everyone, [tensor]))
        return everyone[0]

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's picklable `value`, in rank order (sent as bytes, padded to the
        longest)."""
        mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        lengths = [int(n) for n in self.all_gather(torch.tensor([mine.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[:mine.numel()] = mine
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(self.all_gather(padded), lengths)]

    def exact_average(self, flat: torch.Tensor):
        """The average of `flat` over the replicas the exact way (Gloo's sum, then the
        division): exact DiLoCo. Returns the Work."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.AVG
        with exact():
            return self.backend.allreduce([flat], options)

    def count(self, payload_bytes: int, uncompressed_payload_bytes: int) -> None:
        self.stats["payload_bytes"] += payload_bytes
        self.stats["uncompressed_payload_bytes"] += uncompressed_payload_bytes
        self.stats["peak_payload_bytes"] = max(self.stats["peak_payload_bytes"], payload_bytes)

    def broadcast(self, tensors: list[torch.Tensor], root: int = 0) -> int:
        """The tensors (parameters, or anything a rank holds) take group rank `root`'s
        values, one broadcast per dtype. Returns the bytes broadcast."""
        return move_by_dtype([_local(t) for t in tensors], lambda flat: _wait(self.backend.broadcast(flat, root)))

    # ---- agreement: the replicas' inner step and trained parameters

    def rows(self, kind: int, step: int, trained: list[tuple[str, tuple[int, ...]]], strangers: int,
             device: torch.device, joiners: int = 0) -> torch.Tensor:
        rows = torch.zeros(self.size, _ROW, device=device)
        digest = int.from_bytes(hashlib.blake2b(repr(trained).encode(), digest_size=8).digest(), "little")
        rows[self.rank] = torch.tensor(
            [kind, min(strangers, 0xFFFF), min(joiners, 0xFFFF), *_pieces(step, _STEP_PIECES),
             *_pieces(digest, _DIGEST_PIECES)], dtype=torch.float32)
        return rows

    def agree(self, kind: int, step: int, trained: list[tuple[str, tuple[int, ...]]],
              rows: torch.Tensor) -> _Agreement:
        """Launches the rows alone, the compressed path's way with every value raw (exact):
        its call signature, checked before anything moves, carries the group's call count,
        so it cannot pair with a call of another kind (as an exact call can)."""
        layout: list[Segment] = []
        append_segment(layout, 0, rows.numel(), RAW)
        work = self.backend.allreduce_layout(rows.view(-1), layout, average=True, residual=None)
        return _Agreement(kind, step, trained, rows, work)

    def wait(self, agreement: _Agreement) -> None:
        """Waits for the call carrying the rows and decodes them."""
        if agreement.work is None:
            return
        at = _describe(agreement.kind, agreement.step)
        try:
            agreement.work.wait()
        except CallMismatchError as e:  # a call of another kind, or at another call of the group
            raise RuntimeError(f"cgx.DiLoCo: the replicas are out of step at {at} here: the group's ranks made "
                               f"different calls ({e}); {_OUT_OF_STEP}") from e
        except (CollectiveTimeoutError, PeerError) as e:  # the same kind of error, saying where it happened
            raise type(e)(f"cgx.DiLoCo: {at} failed: {e}; a replica died, or waits in another collective of the "
                          f"group because it is out of step: {_OUT_OF_STEP}") from e
        agreement.rows.mul_(self.size).round_()
        agreement.work = None

    def check(self, agreement: _Agreement) -> None:
        """Raises on every rank alike where the rows differ: RuntimeError for another
        inner step (or a sync against close()), ValueError for another trained set."""
        self.wait(agreement)
        rows = agreement.rows.long().tolist()
        mine = rows[self.rank]
        for peer, row in enumerate(rows):
            if row[0] != mine[0] or _step(row) != _step(mine):
                raise RuntimeError(f"cgx.DiLoCo: the replicas are out of step: {_describe(mine[0], _step(mine))} "
                                   f"here, {_describe(row[0], _step(row))} on group rank {peer}; {_OUT_OF_STEP}")
        for peer, row in enumerate(rows):
            if row[1]:
                raise ValueError(f"cgx.DiLoCo: at the sync of inner step {agreement.step}, inner_optimizer on group "
                                 f"rank {peer} updates {row[1]} tensor(s) that are not parameters of the model: "
                                 f"add param groups of this model's parameters only")
        if any(row[_HEAD + _STEP_PIECES:] != mine[_HEAD + _STEP_PIECES:] for row in rows):
            self._name_difference(agreement)

    def _name_difference(self, agreement: _Agreement) -> None:
        """Raises ValueError naming a parameter trained on one replica and not on another
        (every rank gets here: the digests differ)."""
        everyone = self.all_gather_object(agreement.trained)
        mine = dict(agreement.trained)
        differences = (
            f"{name!r} is trained here, not on group rank {peer}" if name not in theirs
            else f"{name!r} is trained on group rank {peer}, not here" if name not in mine
            else f"{name!r} has shape {list(mine[name])} here, {list(theirs[name])} on group rank {peer}"
            for peer, theirs in enumerate(map(dict, everyone))
            for name in [*mine, *theirs] if mine.get(name) != theirs.get(name))
        raise ValueError(f"cgx.DiLoCo: the replicas' inner optimizers train different parameters at the sync of "
                         f"inner step {agreement.step}: {next(differences)}; every replica must add the same "
                         f"param groups and (un)freeze the same parameters before the same inner step")


@dataclass(eq=False)
class _Fragment:
    """Whole layers that sync together, and their sync: its start (the outer gradient's
    allreduce, with the agreement), its completion, and its application (outer step and
    merge). Its members change only when its sync starts (none of its syncs is in flight
    then)."""

    index: int
    offset: int  # syncs at the steps t with t % sync_every == offset
    members: list[_Member] = field(default_factory=list)
    layout: list[Segment] = field(default_factory=list)  # over the fragment's flat outer gradient
    compressed: list[tuple[str, int, int]] = field(default_factory=list)  # (name, offset, numel)
    outer: torch.optim.SGD | None = None  # None while the fragment has no members
    numel: int = 0
    syncs: int = 0  # syncs applied
    last_start: int = -1  # the inner step its last sync started at

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def set_members(self, members: list[_Member], outer_options: dict[str, Any],
                    momentum: dict[str, torch.Tensor] | None = None) -> None:
        """The fragment's members become `members`; those it kept keep their outer momentum,
        or all take `momentum`'s (name -> buffer) where it is given (a loaded state)."""
        self.members = members
        self.layout, self.compressed, self.numel = [], [], 0
        for m in members:
            numel = m.global_weight.numel()
            if m.setting.compressed and numel > 0:
                self.compressed.append((m.name, self.numel, numel))
            append_segment(self.layout, self.numel, numel, m.setting)
            self.numel += numel
        previous = None if momentum is not None else self.outer
        self.outer = torch.optim.SGD([m.global_weight for m in members], **outer_options) if members else None
        if previous is not None and self.outer is not None:
            kept = {id(m.global_weight) for m in members}
            for g, state in previous.state.items():
                if id(g) in kept:
                    self.outer.state[g] = state
        for m in members if momentum is not None else ():
            if m.name in momentum:
                self.outer.state[m.global_weight] = {"momentum_buffer": momentum[m.name].clone()}

    def change_members(self, leaving: set[str], joining: list[_Member], outer_options: dict[str, Any],
                       residuals: Residuals) -> None:
        """At the sync's start: members named in `leaving` leave, taking their global
        weight (so equal on every replica) and dropping their momentum and residual;
        `joining` join with their global weights."""
        gone = [m for m in self.members if m.name in leaving]
        for m in gone:
            _restore(m)
            residuals.pop(m.name, None)
        self.set_members([m for m in self.members if m not in gone] + joining, outer_options)

    def outer_momentum(self) -> dict[str, torch.Tensor]:
        """Each member's outer momentum buffer (copies), where it has one yet."""
        return {m.name: self.outer.state[m.global_weight]["momentum_buffer"].clone() for m in self.members
                if self.outer.state[m.global_weight].get("momentum_buffer") is not None}

    def start(self, replicas: _Replicas, step: int, due: int, error_feedback: bool,
              trained: list[tuple[str, tuple[int, ...]]], strangers: int, joiners: int = 0,
              keep: bool = False, delta: torch.Tensor | None = None) -> _Sync:
        """Launches the allreduce of the outer gradient (global - local; `delta` instead,
        for a sync done again), the agreement's rows after it (beside it for an exact
        sync). With `keep`, the sync keeps a copy of the outer gradient it sent."""
        # The rows travel with the outer gradient, so they live on its device.
        device = self.members[0].global_weight.device if self.members else torch.device("cpu")
        rows = replicas.rows(_SYNC, step, trained, strangers, device, joiners)
        if not self.members:  # the replicas still agree, on their step above all
            return _Sync(self, due, replicas.agree(_SYNC, step, trained, rows), None, None, None)
        exact_sync = all_raw(self.layout)
        with torch.no_grad():
            if delta is None:
                delta = torch.cat([(m.global_weight - _local(m.param).float()).reshape(-1) for m in self.members])
            sent = delta.clone() if keep else None
            flat = torch.cat([delta, *([] if exact_sync else [rows.view(-1)])])
        residual = None
        if error_feedback and self.compressed:
            residual = replicas.residuals.gather(flat.numel(), self.compressed, flat.device)
        if exact_sync:
            agreement = replicas.agree(_SYNC, step, trained, rows)
            work = replicas.exact_average(flat)
        else:
            layout = list(self.layout)
            append_segment(layout, self.numel, rows.numel(), RAW)
            work = replicas.backend.allreduce_layout(flat, layout, average=True, residual=residual)
            agreement = _Agreement(_SYNC, step, trained, flat[self.numel:].view_as(rows), work)
        return _Sync(self, due, agreement, flat[:self.numel], residual, work, sent)

    def complete(self, sync: _Sync, replicas: _Replicas) -> None:
        """Waits for the sync's allreduce and counts its payload as it went: compressed as
        the layout says, or float32 where CGX_COMPRESSION_AUTO sent it exactly (the
        agreement's rows are not counted)."""
        replicas.wait(sync.agreement)
        if sync.work is None:
            return
        _wait(sync.work)
        replicas.count(layout_bytes(self.layout, replicas.skip_incomplete, _C.sent_exactly(sync.work)),
                       4 * self.numel)
        sync.work = None

    def apply(self, sync: _Sync, replicas: _Replicas, overlap: int, mix: float) -> None:
        """Keeps the residuals the collective left, takes the outer step on the global
        weights, and restarts the local weights from them (mixed, with overlap)."""
        if sync.residual is not None:
            replicas.residuals.keep(sync.residual, self.compressed)
        with torch.no_grad():
            offset = 0
            for m in self.members:
                g = m.global_weight
                g.grad = sync.outer_gradient.narrow(0, offset, g.numel()).view_as(g)
                offset += g.numel()
            self.outer.step()
            for m in self.members:
                g, local = m.global_weight, _local(m.param)
                g.grad = None
                local.copy_(g if overlap == 0 else torch.lerp(g, local.float(), mix))
        replicas.stats["outer_syncs"] += 1
        self.syncs += 1


def _schedule_field(name: str) -> property:
    """DiLoCo's attribute for the hyper-parameter `name` of its _Schedule."""
    def set_field(self, value: Any) -> None:
        self._schedule = dataclasses.replace(self._schedule, **{name: value})
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
                                       overlap, mix, error_feedback)
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
        self._membership = membership  # held: the membership's heartbeats stop once nothing does
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
            self._replicas = _Replicas.of_round(membership.round or membership.next_round())
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
        self._established = False  # holds the run's state (the run started with it, or it took it)
        self._took_state = False  # took it from a live member: a checkpoint would set it apart
        self._ids: list[str] = []  # the replicas of the current round, by Membership.replica_id
        self._elastic_stats = {"rounds": 0, "replicas_lost": 0, "replicas_joined": 0, "syncs_redone": 0,
                               "reform_seconds": 0.0, "bytes_to_joiners": 0}
        if self._host is not None:
            self._warn_if_the_host_waits_less(membership)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        try:
            self._join_the_run()
        except BaseException:
            self._closed = True
            self._hook.remove()  # a DiLoCo that failed to join trains nothing
            raise

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
        weights after every inner step (cgx/replica_host.py)."""
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

    def _join_the_run(self) -> None:
        """The first round of this replica: the run's start, or a join (then the rest of
        the step the members are at). A failure in it re-forms, as in _with_recovery."""
        cause = None
        while True:
            try:
                took = self._enter_round(self._membership.round, cause=None) if cause is None else self._reform(cause)
                break
            except dist.DistError as e:
                if isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                cause = e
        if took:
            self._with_recovery(self._syncs_of_this_step)

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
        fragments = [_Fragment(p, p * schedule.sync_every // schedule.fragments) for p in range(schedule.fragments)]
        for fragment, names in zip(fragments, assignment):
            fragment.set_members([_member(n, params[n], settings[n]) for n in names], schedule.outer_options)
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

    def _syncs_of_this_step(self) -> None:
        """Finishes the syncs due at this step and starts the one whose turn it is. Run
        again after the replicas re-formed (_with_recovery), it does what is left: an
        applied sync has left the in-flight list, and a fragment's sync starts once."""
        admit = False
        for sync in [s for s in self._in_flight if s.due == self.step]:
            admit |= self._finish(sync)
        for fragment in self._fragments:
            if self.step % self.sync_every == fragment.offset and fragment.last_start != self.step:
                self._change_members(fragment)
                trained, strangers = _trained(self._model, self._optimizer)
                joiners = 0 if self._membership is None else self._membership.joiners_waiting()
                if joiners and self._replicas.size >= self._membership.max_replicas:
                    joiners = 0  # the round is full: a joiner waits for a place
                sync = fragment.start(self._replicas, self.step, self.step + self.overlap, self.error_feedback,
                                      trained, strangers, joiners, keep=self._membership is not None)
                self._in_flight.append(sync)
                fragment.last_start = self.step
                if self.overlap == 0:
                    admit |= self._finish(sync)
        if admit and self._reform(cause=None):
            raise _TookState

    def _finish(self, sync: _Sync, follow: bool = True) -> bool:
        """Waits for the sync's allreduce, checks the agreement it carried, then applies it;
        with `follow`, then makes the synced set follow the trained set the replicas agreed
        on. A failed allreduce or agreement raises here and changes nothing (on a group its
        sync is dropped; in an elastic run it stays in flight, to be done again). Returns
        whether a replica saw replicas waiting to join."""
        if self._membership is None:
            self._in_flight.remove(sync)
        stats = self._replicas.stats
        started = time.perf_counter()
        waits = sync.work is not None and (self.overlap == 0 or not sync.work.is_completed())
        joiners = False
        # The agreement first: beside an exact sync it is a call of its own, and where the
        # replicas are out of step the exact sync's Gloo call has no partner to wait for.
        if not sync.checked:
            self._replicas.check(sync.agreement)
            sync.checked = True
            joiners = bool(sync.agreement.rows[:, 2].any())
        if sync.outer_gradient is not None and sync.work is not None:
            stats["waits"] += waits  # without overlap the step always waits
            sync.fragment.complete(sync, self._replicas)
            stats["wait_seconds"] += time.perf_counter() - started
        if self._membership is not None:
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

    # ---- elastic runs: the replicas re-form

    def _with_recovery(self, action: Callable[[], Any]) -> Any:
        """Runs `action`. In an elastic run, where a collective fails (a replica died,
        left or lost its link: PeerError or CollectiveTimeoutError), in `action` or while
        the replicas re-form, the replicas re-form (:meth:`_reform`) and `action` runs
        again, doing what is left. A replica that took another's state and step first
        does the rest of that step's syncs, as the others do."""
        cause, catch_up = None, False
        while True:
            try:
                if cause is not None:
                    catch_up |= self._reform(cause)
                    cause = None
                if catch_up and action != self._syncs_of_this_step:
                    self._syncs_of_this_step()
                catch_up = False
                return action()
            except _TookState:
                catch_up = True
            except dist.DistError as e:
                if self._membership is None or isinstance(e, (CallMismatchError, MembershipError)):
                    raise
                cause = e

    def _reform(self, cause: Exception | None) -> bool:
        """The members move to the next round: after a failure (`cause`), or to admit
        replicas waiting to join. The syncs in flight complete in the old round where
        they can; what the old round did not complete is done again in the new one.
        Returns whether this member took another's state (see :meth:`_enter_round`)."""
        started = time.perf_counter()
        for sync in self._in_flight:
            if sync.completed:
                continue
            try:
                if not sync.checked:
                    self._replicas.check(sync.agreement)
                    sync.checked = True
                sync.fragment.complete(sync, self._replicas)
            except dist.DistError:
                if cause is None:
                    cause = sys.exc_info()[1]
        if cause is not None:
            cause = cause.__cause__ or cause  # the backend's own words, without DiLoCo's out-of-step advice
            _log.warning("cgx.DiLoCo: run %r: a collective failed at inner step %d (%s: %s); the replicas re-form",
                         self._membership.run_id, self.step, type(cause).__name__, cause)
        took = self._enter_round(self._membership.next_round(), cause)
        self._elastic_stats["reform_seconds"] += time.perf_counter() - started
        return took

    def _enter_round(self, round_: Round, cause: Exception | None) -> bool:
        """This replica's part in forming `round_`, alike on every member. Everyone shows
        its position (all_gather_object). A replica built otherwise than the run is
        refused (ValueError on it; the others form the round again without it). Where no
        member holds the run's state yet, the run starts (:meth:`_start_together`). Else
        the reference is the member with the most syncs applied (then the latest step,
        then the lowest rank): every replica whose state differs from it (a joiner; a
        member that missed a sync the reference applied) takes the reference's global
        weights, outer momentum, frozen parameters (sent to it alone), schedule and
        syncs in flight, and restarts its local weights from them. The syncs the reference completed are
        given to whoever lacks them; the others are done again, averaged over the members
        that sent into them. Returns whether this replica took the reference's state."""
        while True:
            previous = self._replicas
            self._replicas = _Replicas.of_round(round_)
            self._replicas.stats = previous.stats  # residuals start over: they belong to a rank of a round
            positions = self._replicas.all_gather_object(self._position())
            refused = _refused(positions)
            if not refused:
                break
            me = self._replicas.rank
            if me in refused:
                self._closed = True
                self._hook.remove()
                self._membership.close()
                raise ValueError(f"cgx.DiLoCo: run {self._membership.run_id!r} refused this replica: {refused[me]}; "
                                 f"every replica must build DiLoCo alike on the same model")
            for rank, difference in refused.items():
                _log.warning("cgx.DiLoCo: run %r refused replica %s: %s", self._membership.run_id,
                             positions[rank]["id"], difference)
            round_ = self._membership.next_round()
        ids = [p["id"] for p in positions]
        self._weights_changed = True
        self._count_members(ids, cause)
        if not any(p["established"] for p in positions):
            if any(p["step"] > 0 for p in positions):
                raise MembershipError(
                    f"cgx.DiLoCo: run {self._membership.run_id!r}: every replica holding the run's state is gone "
                    f"(the others had not finished taking it); restart the run from a checkpoint")
            self._start_together()
            self._established = True
            return False
        reference = max((r for r, p in enumerate(positions) if p["established"]),
                        key=lambda r: (sum(positions[r]["syncs"]), positions[r]["step"], -r))
        takers = [r for r, p in enumerate(positions) if p["state"] != positions[reference]["state"]]
        me = self._replicas.rank
        if me in takers:
            self._established = False  # until the state has arrived: never a reference half-taken
            self._take_position(positions[reference])
        if takers:
            frozen = positions[reference]["layout"]["frozen"]
            self._elastic_stats["bytes_to_joiners"] += self._replicas.send(self._state_tensors(frozen), reference, takers)
            if me in takers:
                self._restart_local_weights()
        self._settle_in_flight(positions, reference, takers)
        self._established = True
        self._took_state |= me in takers
        return me in takers

    def _position(self) -> dict[str, Any]:
        """What this replica shows the others when a round forms."""
        layout = self._layout()
        digest = hashlib.blake2b(repr((self.step, layout)).encode(), digest_size=16)
        for t in self._state_tensors(layout["frozen"]) if self._established else ():
            digest.update(_local(t).detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
        return {
            "id": self._membership.replica_id,
            "established": self._established,
            "construction": {**dataclasses.asdict(self._schedule),
                             "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._model.named_parameters()],
                             # Every parameter's, frozen or not: the run may have unfrozen some.
                             "settings": [(n, self._member_setting(n, p)) for n, p in self._model.named_parameters()],
                             "trained parameters": _trained(self._model, self._optimizer)[0]},
            "step": self.step,
            "syncs": [f.syncs for f in self._fragments],
            "state": digest.hexdigest() if self._established else None,
            "layout": layout,
            "in_flight": [{"key": s.key, "completed": s.completed, "sent": s.sent is not None}
                          for s in self._in_flight],
        }

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

    def _take_position(self, reference: dict[str, Any]) -> None:
        """Takes the reference's layout, schedule and syncs in flight (the tensors follow
        by broadcast). A sync in flight here that the reference also has keeps what this
        replica sent into it, so that it can be done again with it."""
        layout = reference["layout"]
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
        self.step = reference["step"]
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

    def _settle_in_flight(self, positions: list[dict[str, Any]], reference: int, takers: list[int]) -> None:
        """The syncs in flight, as the reference has them: the averages it completed are
        sent to every member that lacks them; the syncs it did not complete are done again in
        this round, each member sending what it sent before (scaled, so that the average
        is over those that sent) or zeros. Residuals from the old round are dropped."""
        size = self._replicas.size
        theirs = [{tuple(e["key"]): e for e in p["in_flight"]} for p in positions]
        again = []
        for i, entry in enumerate(positions[reference]["in_flight"]):
            key = tuple(entry["key"])
            sync = self._in_flight[i]
            sync.residual = None
            if entry["completed"]:
                lacking = [r for r in range(size) if r in takers or not theirs[r][key]["completed"]]
                if lacking and sync.outer_gradient is not None:
                    self._replicas.send([sync.outer_gradient], reference, lacking)
                sync.work, sync.agreement.work, sync.checked = None, None, True
            else:
                again.append((i, sum(1 for r in range(size) if key in theirs[r] and theirs[r][key]["sent"])))
        for i, senders in again:
            old = self._in_flight[i]
            fragment = old.fragment
            delta = None
            if fragment.members:
                delta = (old.sent * (size / senders) if old.sent is not None
                         else torch.zeros(fragment.numel, device=fragment.members[0].global_weight.device))
            sync = fragment.start(self._replicas, old.agreement.step, old.due, self.error_feedback,
                                  old.agreement.trained, 0, delta=delta)
            sync.sent = old.sent
            self._in_flight[i] = sync
            self._elastic_stats["syncs_redone"] += 1

    def _count_members(self, ids: list[str], cause: Exception | None) -> None:
        """Counts and logs the replicas that are gone from, or new in, the round."""
        stats = self._elastic_stats
        stats["rounds"] += 1
        if self._ids:
            run = self._membership.run_id
            for gone in sorted(set(self._ids) - set(ids)):
                stats["replicas_lost"] += 1
                _log.warning("cgx.DiLoCo: run %r: replica %s is gone (%s); %d replicas go on", run, gone,
                             "it left or died" if cause is None else f"{type(cause).__name__}: {cause}", len(ids))
            for new in sorted(set(ids) - set(self._ids)):
                stats["replicas_joined"] += 1
                _log.info("cgx.DiLoCo: run %r: replica %s joined; %d replicas", run, new, len(ids))
        self._ids = ids

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
        if self._membership is None:
            raise RuntimeError("cgx.DiLoCo.leave: only a replica of an elastic run (membership=...) leaves; "
                               "a group's replicas end together with close()")
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        self._in_flight.clear()
        self._membership.close()
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
            return Stats({"step": self.step}, _RENAMED)  # the replica's stats are its lead's
        elastic = {} if self._membership is None else {"replicas": self._replicas.size, **self._elastic_stats}
        return Stats({"step": self.step, **self._replicas.stats, "in_flight": len(self._in_flight), **elastic},
                     _RENAMED)

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
        if self._membership is not None and self._took_state:
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
        self._replicas.stats = {_RENAMED.get(k, k): v for k, v in state["stats"].items()}  # older names too
        for fragment, syncs in zip(self._fragments, state.get("syncs", [0] * len(self._fragments))):
            fragment.syncs = syncs
        self._in_flight = [
            _Sync(self._fragments[s["fragment"]], s["due"],
                  _Agreement(_SYNC, s["step"], s["trained"], _current_rows(s["agreement"]), None),
                  None if s["outer_gradient"] is None else s["outer_gradient"].clone(),
                  None if s["residual"] is None else s["residual"].clone(), None)
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


class _TookState(Exception):
    """This replica took another's state and step as the round formed: the step's syncs
    run again from the top (as that member has them)."""


def _refused(positions: list[dict[str, Any]]) -> dict[int, str]:
    """The ranks of a forming round whose DiLoCo is built otherwise than the run's (its
    members' with the lowest rank), each with the first difference. None are refused at
    the run's start: there every rank fails (_agree_on_construction)."""
    established = [r for r, p in enumerate(positions) if p["established"]]
    if not established:
        return {}
    run = positions[min(established)]["construction"]
    refused = {}
    for rank, position in enumerate(positions):
        for name, value in run.items():
            theirs = position["construction"].get(name)
            if theirs == value:
                continue
            if isinstance(value, list) and isinstance(theirs, list):  # name the entries that differ
                only_here = [x for x in theirs if x not in value][:2]
                only_run = [x for x in value if x not in theirs][:2]
                refused[rank] = (f"its {name} differ from the run's: it has {only_here or 'nothing more'}, "
                                 f"the run {only_run or 'nothing more'}")
            else:
                refused[rank] = f"its {name} differ from the run's: {theirs!r} against {value!r}"
            break
    return refused


_STATE_KEYS = ("rank", "world_size", "fragments", "joining", "leaving", "step", "global_weights", "outer_momentum",
               "residuals", "in_flight", "stats")


def _local(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: the local shard of an FSDP2 DTensor, else the
    parameter itself (in-place writes reach the parameter either way)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _member(name: str, param: torch.Tensor, setting: LayerSetting) -> _Member:
    with torch.no_grad():
        return _Member(name, param, _local(param).detach().float().clone(), setting)


def _restore(member: _Member) -> None:
    """A parameter that is no longer synced keeps its global weight: equal on every replica."""
    with torch.no_grad():
        _local(member.param).copy_(member.global_weight)


def _wait(work: Any) -> None:
    """Waits for a Work. Where it went the exact way (Gloo: exact syncs, all_gather,
    broadcast, send, recv), a failure of the link or of a peer arrives as Gloo's plain
    RuntimeError naming its transport; it is raised as the compressed path raises it,
    PeerError or CollectiveTimeoutError, so that every path of a sync fails alike."""
    try:
        work.wait()
    except RuntimeError as e:
        if isinstance(e, dist.DistError) or "gloo/transport" not in str(e):
            raise
        kind = CollectiveTimeoutError if "Timed out" in str(e) else PeerError
        raise kind(f"an exact (Gloo) call failed: {e}") from e


def _current_rows(rows: torch.Tensor) -> torch.Tensor:
    """A checkpoint's agreement rows in this version's layout (before the joiners
    column, a row was kind, strangers, step, digest)."""
    if rows.shape[-1] == _ROW - 1:
        return torch.cat([rows[:, :2], torch.zeros_like(rows[:, :1]), rows[:, 2:]], dim=1)
    return rows.clone()


def _pieces(value: int, count: int) -> list[int]:
    return [(value >> (16 * i)) & 0xFFFF for i in range(count)]


def _step(row: list[int]) -> int:
    return sum(piece << (16 * i) for i, piece in enumerate(row[_HEAD:_HEAD + _STEP_PIECES]))


def _describe(kind: int, step: int) -> str:
    return f"the sync of inner step {step}" if kind == _SYNC else f"close() after inner step {step}"


def _trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """(name, shape) of the model's parameters the optimizer updates (in the optimizer,
    requiring grad), in model order; and how many tensors it holds that are not the model's."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = list(model.named_parameters())
    strangers = len(held - {id(p) for _, p in named})
    return [(n, tuple(p.shape)) for n, p in named if id(p) in held and p.requires_grad], strangers


def _synced_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's parameters the optimizer updates, by name, in model order; ValueError
    if the optimizer holds parameters that are not the model's, or none of them."""
    trained, strangers = _trained(model, optimizer)
    if strangers:
        raise ValueError(f"cgx.DiLoCo: inner_optimizer updates {strangers} tensor(s) that are not "
                         f"parameters of the model: give the optimizer of this model's parameters")
    if not trained:
        raise ValueError("cgx.DiLoCo: inner_optimizer updates none of the model's trainable parameters")
    params = dict(model.named_parameters())
    return {n: params[n] for n, _ in trained}


def _layers(params: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Parameter names grouped by the module that owns them, in model order."""
    layers: dict[str, list[str]] = {}
    for name in params:
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    return layers


def _assign(params: dict[str, torch.Tensor], layers: dict[str, list[str]], fragments: int,
            pattern: str) -> list[list[str]]:
    """The parameter names of each fragment, whole layers each (see DiLoCo's
    `fragment_pattern`). A layer's size is its parameters' (global) number of elements, the
    same on every rank."""
    members = list(layers.values())
    choice = _split([sum(params[n].numel() for n in names) for names in members], fragments, pattern)
    return [[n for names, p in zip(members, choice) if p == q for n in names] for q in range(fragments)]


def _split(sizes: list[int], fragments: int, pattern: str) -> list[int]:
    """The fragment of each layer, given the layers' sizes in model order. Either pattern
    keeps every fragment within 1/P of the total plus one layer (list scheduling: a layer
    goes to a fragment that holds at most the average)."""
    load = [0] * fragments
    taken = [0] * fragments
    choice = []
    if pattern == "strided":
        turn = 0
        for size in sizes:  # the least loaded fragment (the fewest layers, the next in turn)
            p = min(range(fragments), key=lambda q: (load[q], taken[q], (q - turn) % fragments))
            choice.append(p)
            load[p] += size
            taken[p] += 1
            turn = (p + 1) % fragments
        return choice
    total, p, so_far = sum(sizes), 0, 0
    for i, size in enumerate(sizes):
        choice.append(p)
        so_far += size
        layers_left = len(sizes) - 1 - i
        if p < fragments - 1 and (so_far * fragments >= (p + 1) * total or layers_left == fragments - 1 - p):
            p += 1
    return choice


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
