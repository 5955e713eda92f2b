"""The replicas of a DiLoCo run as one rank sees them (a group's, or an elastic round's),
their collectives, and the agreement that rides on every sync: each replica's inner step,
trained parameters, joiners seen and state digest, checked alike on every rank."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cgx import _C
from cgx.backend import exact, get_backend
from cgx.counters import no_exact
from cgx.diloco.tensors import local, move_by_dtype
from cgx.elastic import Round
from cgx.errors import CallMismatchError, CollectiveTimeoutError, PeerError
from cgx.layers import RAW, Segment, append_segment
from cgx.residuals import Residuals, place

# The replicas' agreement rides on each sync: its buffer ends with a raw (exact) row per
# rank, each rank filling its own and zeros elsewhere, so after the average every rank holds
# every rank's row over the group size (multiplied back and rounded: exact). A row: what
# the call is for, the tensors the optimizer holds that are not the model's, the inner step
# and a digest of the trained parameters, these two in 16-bit pieces (float32 carries them
# exactly). close(), a fragment without members and an exact (Gloo) sync, whose sums a
# longer buffer would order otherwise, send the rows alone. In an elastic run a row also
# says how many replicas waiting to join this replica saw, or, once the members form the
# round that admits them beside training, READY where this replica's is formed (the
# members admit them together, and move to that round together) and LEFT_OUT where torch
# formed it without this replica (the members form it again), and carries a digest of
# the fragment's global weights and outer momentum after its last applied sync: a replica
# whose state differs is healed (ReplicasDiverged). Under a time schedule the step column
# holds the sync's number (the replicas' inner steps differ), and a row ends with the inner
# steps behind this replica's outer gradient: the sync's weights (syncs.py).
SYNC, CLOSE = 0, 1
_STEP_PIECES, _DIGEST_PIECES = 3, 4
_HEAD = 3  # kind, strangers, joiners (or READY, LEFT_OUT)
READY, LEFT_OUT = 0xFFFF, 0xFFFE
_TRAINED = _HEAD + _STEP_PIECES  # where the trained parameters' digest starts
_STATE = _TRAINED + _DIGEST_PIECES  # where the fragment's global weights' digest starts (0: not given)
_WORK = _STATE + _DIGEST_PIECES  # the inner steps behind the outer gradient (time schedule; else 0)
_WORK_PIECES = 2
ROW = _WORK + _WORK_PIECES
_OUT_OF_STEP = ("every replica must call the inner optimizer's step() alike: DiLoCo counts those calls, and "
                "GradScaler skips step() on a replica whose gradients have Inf/NaN (make the replicas skip together)")
_OUT_OF_STEP_BY_TIME = ("with sync_every a time, the replicas' inner steps differ and they must end together at a "
                        "sync: stop each replica's loop at the same DiLoCo.syncs_started, then call close()")


@dataclass(eq=False)
class Agreement:
    """What this rank said at a sync's start or at close(), and every rank's rows."""

    kind: int  # SYNC or CLOSE
    step: int
    trained: list[tuple[str, tuple[int, ...]]]  # (name, shape) of what the optimizer trains, model order
    rows: torch.Tensor  # (group size, ROW) float32: every rank's row once `work` completed
    work: Any  # the call carrying the rows (the sync's, or theirs alone); None once done and they are decoded


class Replicas:
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
        self.stats = fresh_stats()
        self.by_time = False  # a time schedule's: rows carry sync numbers, not inner steps

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> Replicas:
        return cls(get_backend(group), dist.get_rank(group), group.size(), group)  # ValueError: not cgx's

    @classmethod
    def of_round(cls, round_: Round) -> Replicas:
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
        moved = move_by_dtype([local(t) for t in tensors], move)
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

    def broadcast(self, tensors: list[torch.Tensor], root: int = 0) -> int:
        """The tensors (parameters, or anything a rank holds) take group rank `root`'s
        values, one broadcast per dtype. Returns the bytes broadcast."""
        return move_by_dtype([local(t) for t in tensors], lambda flat: self.backend.broadcast(flat, root).wait())

    # ---- agreement: the replicas' inner step and trained parameters

    def rows(self, kind: int, step: int, trained: list[tuple[str, tuple[int, ...]]], strangers: int,
             device: torch.device, joiners: int = 0, state: int = 0, work: int = 0) -> torch.Tensor:
        rows = torch.zeros(self.size, ROW, device=device)
        digest = int.from_bytes(hashlib.blake2b(repr(trained).encode(), digest_size=8).digest(), "little")
        rows[self.rank] = torch.tensor(
            [kind, min(strangers, 0xFFFF), min(joiners, READY), *_pieces(step, _STEP_PIECES),
             *_pieces(digest, _DIGEST_PIECES), *_pieces(state, _DIGEST_PIECES),
             *_pieces(min(work, 0xFFFFFFFF), _WORK_PIECES)], dtype=torch.float32)
        return rows

    def agree(self, kind: int, step: int, trained: list[tuple[str, tuple[int, ...]]],
              rows: torch.Tensor) -> Agreement:
        """Launches the rows alone, the compressed path's way with every value raw (exact):
        its call signature, checked before anything moves, carries the group's call count,
        so it cannot pair with a call of another kind (as an exact call can)."""
        layout: list[Segment] = []
        append_segment(layout, 0, rows.numel(), RAW)
        work = self.backend.allreduce_layout(rows.view(-1), layout, average=True, residual=None)
        return Agreement(kind, step, trained, rows, work)

    def agree_to_close(self, step: int) -> Agreement:
        """close() after inner step `step`: the rows alone, checked as a sync's are."""
        return self.agree(CLOSE, step, [], self.rows(CLOSE, step, [], 0, torch.device("cpu")))

    def wait(self, agreement: Agreement) -> None:
        """Waits for the call carrying the rows and decodes them."""
        if agreement.work is None:
            return
        at = self._describe(agreement.kind, agreement.step)
        try:
            agreement.work.wait()
        except CallMismatchError as e:  # a call of another kind, or at another call of the group
            raise RuntimeError(f"cgx.DiLoCo: the replicas are out of step at {at} here: the group's ranks made "
                               f"different calls ({e}); {self._advice}") from e
        except (CollectiveTimeoutError, PeerError) as e:  # the same kind of error, saying where it happened
            raise type(e)(f"cgx.DiLoCo: {at} failed: {e}; a replica died, or waits in another collective of the "
                          f"group because it is out of step: {self._advice}") from e
        agreement.rows.mul_(self.size).round_()
        agreement.work = None

    def check(self, agreement: Agreement) -> None:
        """Raises on every rank alike where the rows differ: RuntimeError for another
        inner step (or a sync against close()), ValueError for another trained set."""
        self.wait(agreement)
        rows = agreement.rows.long().tolist()
        mine = rows[self.rank]
        for peer, row in enumerate(rows):
            if row[0] != mine[0] or _step(row) != _step(mine):
                raise RuntimeError(f"cgx.DiLoCo: the replicas are out of step: "
                                   f"{self._describe(mine[0], _step(mine))} here, {self._describe(row[0], _step(row))} "
                                   f"on group rank {peer}; {self._advice}")
        for peer, row in enumerate(rows):
            if row[1]:
                raise ValueError(f"cgx.DiLoCo: at {self._describe(SYNC, agreement.step)}, inner_optimizer on group "
                                 f"rank {peer} updates {row[1]} tensor(s) that are not parameters of the model: "
                                 f"add param groups of this model's parameters only")
        if any(row[_TRAINED:_STATE] != mine[_TRAINED:_STATE] for row in rows):
            self._name_difference(agreement)
        states = [tuple(row[_STATE:_WORK]) for row in rows]
        if len(set(states)) > 1:
            ranks = {}
            for rank, state in enumerate(states):
                ranks.setdefault(state, []).append(rank)
            raise ReplicasDiverged(f"cgx.DiLoCo: at {self._describe(SYNC, agreement.step)}, the replicas' global "
                                   f"weights or outer momentum of the fragment differ after its last applied sync: "
                                   f"group ranks "
                                   f"{' | '.join(map(str, ranks.values()))} each hold other weights (a bit flip, a "
                                   f"non-deterministic op, a bug)")

    def _describe(self, kind: int, step: int) -> str:
        """A sync or close() by what its row's step column holds."""
        at = f"sync number {step}" if self.by_time else f"inner step {step}"
        return (f"the sync of {at}" if not self.by_time else at) if kind == SYNC else f"close() after {at}"

    @property
    def _advice(self) -> str:
        return _OUT_OF_STEP_BY_TIME if self.by_time else _OUT_OF_STEP

    def _name_difference(self, agreement: Agreement) -> None:
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
        when = ("between the same two syncs: with sync_every a time, the replicas' inner steps differ, so key the "
                "change to DiLoCo.syncs_started" if self.by_time else "before the same inner step")
        raise ValueError(f"cgx.DiLoCo: the replicas' inner optimizers train different parameters at "
                         f"{self._describe(SYNC, agreement.step)}: {next(differences)}; every replica must add the same "
                         f"param groups and (un)freeze the same parameters {when}")


def current_rows(rows: torch.Tensor) -> torch.Tensor:
    """A checkpoint's agreement rows in this version's layout (before the joiners
    column, a row was kind, strangers, step, digest; before the state's digest, it ended
    with the trained parameters' digest; before the work column, with the state's)."""
    if rows.shape[-1] == _STATE - 1:
        rows = torch.cat([rows[:, :2], torch.zeros_like(rows[:, :1]), rows[:, 2:]], dim=1)
    for end, pieces in ((_STATE, _DIGEST_PIECES), (_WORK, _WORK_PIECES)):
        if rows.shape[-1] == end:
            rows = torch.cat([rows, torch.zeros(rows.shape[0], pieces, dtype=rows.dtype)], dim=1)
    if rows.shape[-1] != ROW:
        raise ValueError(f"cgx.DiLoCo: a checkpoint's agreement rows have {rows.shape[-1]} columns, a layout of no "
                         f"cgx version ({_STATE - 1}, {_STATE}, {_WORK} or {ROW})")
    return rows.clone()


def work_of(rows: torch.Tensor) -> list[int]:
    """Each rank's work column of checked rows: the inner steps behind its outer gradient."""
    return [_joined(row, _WORK, _WORK_PIECES) for row in rows.long().tolist()]


def fresh_stats() -> dict[str, Any]:
    """DiLoCo's sync counters before any sync (docs/stats.md)."""
    return {"outer_syncs": 0, "payload_bytes": 0, "uncompressed_payload_bytes": 0, "peak_payload_bytes": 0,
            **no_exact(), "waits": 0, "wait_seconds": 0.0}


class ReplicasDiverged(dist.DistError):
    """The replicas' global weights of a fragment differ where they must be identical. In
    an elastic run the replicas re-form on it, and those that differ from the reference
    take its state (recovery.py)."""


def _pieces(value: int, count: int) -> list[int]:
    return [(value >> (16 * i)) & 0xFFFF for i in range(count)]


def _joined(row: list[int], start: int, count: int) -> int:
    """The value _pieces cut into `count` pieces, from row[start:]."""
    return sum(piece << (16 * i) for i, piece in enumerate(row[start:start + count]))


def _step(row: list[int]) -> int:
    return _joined(row, _HEAD, _STEP_PIECES)

