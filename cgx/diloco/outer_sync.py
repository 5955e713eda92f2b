"""The pieces of Streaming DiLoCo's outer syncs (diloco.py holds the class that runs
them): the schedule's settings, a synced parameter (member) with its global copy, the
replicas' agreement that rides on each sync, a sync in flight, the replicas (a group or an
elastic round) with their collectives, and a fragment of whole layers with its outer
optimizer; helpers for parameters and layers at the end."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cgx import _C
from cgx.backend import exact, get_backend
from cgx.config import check_int
from cgx.diloco.replica_host import move_by_dtype
from cgx.diloco.sparse import SparsePlan, TopK
from cgx.elastic import Round
from cgx.errors import CallMismatchError, CollectiveTimeoutError, PeerError
from cgx.layers import RAW, LayerSetting, Segment, all_raw, append_segment, layout_bytes
from cgx.residuals import Residuals, place

_PATTERNS = ("strided", "sequential")

# The replicas' agreement rides on each sync: its buffer ends with a raw (exact) row per
# rank, each rank filling its own and zeros elsewhere, so after the average every rank holds
# every rank's row over the group size (multiplied back and rounded: exact). A row: what
# the call is for, the tensors the optimizer holds that are not the model's, the inner step
# and a digest of the trained parameters, these two in 16-bit pieces (float32 carries them
# exactly). close(), a fragment without members and an exact (Gloo) sync, whose sums a
# longer buffer would order otherwise, send the rows alone. In an elastic run a row also
# says how many replicas waiting to join this replica saw, or, once the members form the
# round that admits them beside training, _READY where this replica's is formed (the
# members admit them together, and move to that round together) and _LEFT_OUT where torch
# formed it without this replica (the members form it again), and carries a digest of
# the fragment's global weights and outer momentum after its last applied sync: a replica
# whose state differs is healed (ReplicasDiverged).
_SYNC, _CLOSE = 0, 1
_STEP_PIECES, _DIGEST_PIECES = 3, 4
_HEAD = 3  # kind, strangers, joiners (or _READY, _LEFT_OUT)
_READY, _LEFT_OUT = 0xFFFF, 0xFFFE
_TRAINED = _HEAD + _STEP_PIECES  # where the trained parameters' digest starts
_STATE = _TRAINED + _DIGEST_PIECES  # where the fragment's global weights' digest starts (0: not given)
_ROW = _STATE + _DIGEST_PIECES
_OUT_OF_STEP = ("every replica must call the inner optimizer's step() alike: DiLoCo counts those calls, and "
                "GradScaler skips step() on a replica whose gradients have Inf/NaN (make the replicas skip together)")


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
    top_k: TopK | None = None

    def __post_init__(self) -> None:
        what = "cgx.DiLoCo"
        if self.top_k is not None and not isinstance(self.top_k, TopK):
            raise TypeError(f"{what}: top_k must be a cgx.diloco.TopK or None, got {type(self.top_k).__name__}")
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
class _SharedPlaces:
    """A sparse sync with shared places, in flight: where its values go back."""

    places: list[torch.Tensor | None]  # SparsePlan.shared_places
    averaged: torch.Tensor  # the allreduce's values (the average, once it completed)
    dropped: torch.Tensor | None  # what the allreduce's quantizations dropped (error feedback)


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
    payloads: list[torch.Tensor] | None = None  # a sparse sync's: every rank's, once `work` completed
    shared: _SharedPlaces | None = None  # a sparse sync's with shared places, until it completed
    drift: torch.Tensor | None = None  # a sparse sync's outer gradient as measured (with error feedback)

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
                    work.wait()
            else:
                self.backend.recv([flat], root, 0).wait()
        moved = move_by_dtype([_local(t) for t in tensors], move)
        return moved * len(to) if self.rank == root else 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (one shape on all), in rank order."""
        everyone = [[torch.empty_like(tensor) for _ in range(self.size)]]
        self.backend.allgather(everyone, [tensor]).wait()
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
        return move_by_dtype([_local(t) for t in tensors], lambda flat: self.backend.broadcast(flat, root).wait())

    # ---- agreement: the replicas' inner step and trained parameters

    def rows(self, kind: int, step: int, trained: list[tuple[str, tuple[int, ...]]], strangers: int,
             device: torch.device, joiners: int = 0, state: int = 0) -> torch.Tensor:
        rows = torch.zeros(self.size, _ROW, device=device)
        digest = int.from_bytes(hashlib.blake2b(repr(trained).encode(), digest_size=8).digest(), "little")
        rows[self.rank] = torch.tensor(
            [kind, min(strangers, 0xFFFF), min(joiners, _READY), *_pieces(step, _STEP_PIECES),
             *_pieces(digest, _DIGEST_PIECES), *_pieces(state, _DIGEST_PIECES)], dtype=torch.float32)
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
        if any(row[_TRAINED:_STATE] != mine[_TRAINED:_STATE] for row in rows):
            self._name_difference(agreement)
        states = [tuple(row[_STATE:]) for row in rows]
        if len(set(states)) > 1:
            ranks = {}
            for rank, state in enumerate(states):
                ranks.setdefault(state, []).append(rank)
            raise ReplicasDiverged(f"cgx.DiLoCo: at the sync of inner step {agreement.step}, the replicas' global "
                                   f"weights or outer momentum of the fragment differ after its last applied sync: "
                                   f"group ranks "
                                   f"{' | '.join(map(str, ranks.values()))} each hold other weights (a bit flip, a "
                                   f"non-deterministic op, a bug)")

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
    top_k: TopK | None = None  # the outer gradients' sparsity (None: dense)
    members: list[_Member] = field(default_factory=list)
    layout: list[Segment] = field(default_factory=list)  # over the fragment's flat outer gradient
    compressed: list[tuple[str, int, int]] = field(default_factory=list)  # (name, offset, numel)
    outer: torch.optim.SGD | None = None  # None while the fragment has no members
    numel: int = 0
    sparse: SparsePlan | None = None  # how its outer gradient travels with top_k (None: in an allreduce)
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
        self.sparse = SparsePlan(self.layout, self.top_k) if self.top_k and not all_raw(self.layout) else None
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
              keep: bool = False, delta: torch.Tensor | None = None, scale: float | None = None) -> _Sync:
        """Launches the allreduce of the outer gradient (global - local, times `scale`
        where given: this replica's weight in the average; `delta` instead, for a sync
        done again), the agreement's rows after it (beside it for an exact or a sparse
        sync: an all-gather of every rank's payload). With `keep`, the sync keeps a copy
        of the outer gradient it sent (before `scale`)."""
        # The rows travel with the outer gradient, so they live on its device.
        device = self.members[0].global_weight.device if self.members else torch.device("cpu")
        state = _digest([m.global_weight for m in self.members] + [
            self.outer.state[m.global_weight]["momentum_buffer"] for m in self.members
            if self.outer.state[m.global_weight].get("momentum_buffer") is not None]) if keep and self.members else 0
        rows = replicas.rows(_SYNC, step, trained, strangers, device, joiners, state)
        if not self.members:  # the replicas still agree, on their step above all
            return _Sync(self, due, replicas.agree(_SYNC, step, trained, rows), None, None, None)
        exact_sync = all_raw(self.layout)
        with torch.no_grad():
            if delta is None:
                delta = torch.cat([(m.global_weight - _local(m.param).float()).reshape(-1) for m in self.members])
            sent = delta.clone() if keep else None
            drift = None  # (unscaled; one copy with `sent`: neither is written after)
            if self.sparse is not None and error_feedback and self.compressed:
                drift = sent if sent is not None else delta.clone()
            if scale is not None:
                delta.mul_(scale)
            if self.sparse is not None:
                sync = (self._start_shared(replicas, step, due, trained, rows, delta, error_feedback, sent)
                        if self.top_k.shared else
                        self._start_sparse(replicas, due, replicas.agree(_SYNC, step, trained, rows), delta,
                                           error_feedback, sent))
                sync.drift = drift
                return sync
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

    def _start_sparse(self, replicas: _Replicas, due: int, agreement: _Agreement, delta: torch.Tensor,
                      error_feedback: bool, sent: torch.Tensor | None) -> _Sync:
        """A sparse sync's start: this rank's payload (delta plus its residual, decayed)
        and the all-gather of every rank's; the residual becomes what the payload does
        not carry."""
        values, residual = self._with_residual(replicas, delta, error_feedback)
        payload, carried = self.sparse.encode(values)
        if residual is not None:
            torch.sub(values, carried, out=residual)
        payloads = [torch.empty_like(payload) for _ in range(replicas.size)]
        work = replicas.backend.allgather([payloads], [payload])
        return _Sync(self, due, agreement, torch.zeros_like(delta), residual, work, sent, payloads=payloads)

    def _start_shared(self, replicas: _Replicas, step: int, due: int, trained: list[tuple[str, tuple[int, ...]]],
                      rows: torch.Tensor, delta: torch.Tensor, error_feedback: bool,
                      sent: torch.Tensor | None) -> _Sync:
        """A sparse sync with shared places: the values (delta plus the residual, decayed)
        at the places every replica draws from the sync's step, in cgx's compressed
        allreduce with the agreement's rows. The residual becomes the values, but at the
        places sent: what the allreduce dropped of them (filled in at completion)."""
        values, residual = self._with_residual(replicas, delta, error_feedback)
        places = self.sparse.shared_places(step * 65536 + self.index, delta.device)
        selected = self.sparse.select(values, places)
        flat = torch.cat([selected, rows.view(-1)])
        layout = self.sparse.selected_layout()
        append_segment(layout, selected.numel(), rows.numel(), RAW)
        dropped = torch.zeros_like(flat) if residual is not None else None
        work = replicas.backend.allreduce_layout(flat, layout, average=True, residual=dropped)
        if residual is not None:
            residual.copy_(values)
        agreement = _Agreement(_SYNC, step, trained, flat[selected.numel():].view_as(rows), work)
        return _Sync(self, due, agreement, torch.zeros_like(delta), residual, work, sent,
                     shared=_SharedPlaces(places, flat[:selected.numel()], dropped))

    def _with_residual(self, replicas: _Replicas, delta: torch.Tensor,
                       error_feedback: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A sparse sync's values, delta plus this rank's residual times the decay, and
        the residual (None without error feedback)."""
        if not (error_feedback and self.compressed):
            return delta, None
        residual = replicas.residuals.gather(self.numel, self.compressed, delta.device)
        return delta + self.top_k.decay * residual, residual

    def complete(self, sync: _Sync, replicas: _Replicas) -> None:
        """Waits for the sync's allreduce and counts its payload as it went: compressed as
        the layout says, or float32 where CGX_COMPRESSION_AUTO sent it exactly (the
        agreement's rows are not counted). A sparse sync's average: every rank's payload
        decoded and summed in rank order (alike on every rank), over the ranks."""
        replicas.wait(sync.agreement)
        if sync.work is None:
            return
        sync.work.wait()
        if sync.shared is not None:
            shared = sync.shared
            self.sparse.put(shared.averaged, shared.places, sync.outer_gradient)
            if sync.residual is not None:
                self.sparse.put(shared.dropped.narrow(0, 0, shared.averaged.numel()), shared.places, sync.residual)
            replicas.count(layout_bytes(self.sparse.selected_layout(), replicas.skip_incomplete,
                                        _C.sent_exactly(sync.work)),
                           4 * self.numel)
            sync.shared = None
        elif sync.payloads is not None:
            sync.outer_gradient.zero_()
            for payload in sync.payloads:
                self.sparse.add(payload, sync.outer_gradient)
            sync.outer_gradient.div_(len(sync.payloads))
            replicas.count(self.sparse.nbytes, 4 * self.numel)
            sync.payloads = None
        else:
            replicas.count(layout_bytes(self.layout, replicas.skip_incomplete, _C.sent_exactly(sync.work)),
                           4 * self.numel)
        sync.work = None

    def apply(self, sync: _Sync, replicas: _Replicas, overlap: int, mix: float) -> None:
        """Takes the outer step on the global weights, keeps the residuals the collective
        left, and restarts the local weights from the global ones (mixed, with overlap).
        A sparse sync's residual holds all of what this rank did not send; with overlap and
        mix, the local weights keep `mix` of their drift from the new global weights, which
        the next outer gradient measures again: that part leaves the residual (it would be
        sent twice: random places, sent rarely, diverged so)."""
        with torch.no_grad():
            retains = sync.drift is not None and sync.residual is not None and overlap > 0 and mix > 0
            before = torch.cat([m.global_weight.reshape(-1) for m in self.members]) if retains else None
            offset = 0
            for m in self.members:
                g = m.global_weight
                g.grad = sync.outer_gradient.narrow(0, offset, g.numel()).view_as(g)
                offset += g.numel()
            self.outer.step()
            if retains:
                stepped = before.sub_(torch.cat([m.global_weight.reshape(-1) for m in self.members]))
                sync.residual.sub_((sync.drift - stepped).mul_(mix))
            if sync.residual is not None:
                replicas.residuals.keep(sync.residual, self.compressed)
            for m in self.members:
                g, local = m.global_weight, _local(m.param)
                g.grad = None
                local.copy_(g if overlap == 0 else torch.lerp(g, local.float(), mix))
        replicas.stats["outer_syncs"] += 1
        self.syncs += 1



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


def _current_rows(rows: torch.Tensor) -> torch.Tensor:
    """A checkpoint's agreement rows in this version's layout (before the joiners
    column, a row was kind, strangers, step, digest; before the state's digest, it ended
    with the trained parameters' digest)."""
    if rows.shape[-1] == _STATE - 1:
        rows = torch.cat([rows[:, :2], torch.zeros_like(rows[:, :1]), rows[:, 2:]], dim=1)
    if rows.shape[-1] == _STATE:
        return torch.cat([rows, torch.zeros(rows.shape[0], _DIGEST_PIECES, dtype=rows.dtype)], dim=1)
    if rows.shape[-1] != _ROW:
        raise ValueError(f"cgx.DiLoCo: a checkpoint's agreement rows have {rows.shape[-1]} columns, a layout of no "
                         f"cgx version ({_STATE - 1}, {_STATE} or {_ROW})")
    return rows.clone()


def _digest(tensors: list[torch.Tensor]) -> int:
    """A nonzero 64-bit digest of the tensors' bytes (their values, bit for bit)."""
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        digest.update(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") or 1


class ReplicasDiverged(dist.DistError):
    """The replicas' global weights of a fragment differ where they must be identical. In
    an elastic run the replicas re-form on it, and those that differ from the reference
    take its state (recovery.py)."""


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
