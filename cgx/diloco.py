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
replica's own). Under FSDP2 the outer step runs on each rank's local shards; ``group``
then pairs the ranks holding the same shard in each replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cgx.agreement import first_difference
from cgx.backend import exact, get_backend
from cgx.hooks import check_same_place
from cgx.layers import (RAW_BITS, CompressionPolicy, LayerSetting, Segment, append_segment, check_bits,
                        check_bucket_size, layout_bytes)

__all__ = ["DiLoCo"]

_PATTERNS = ("strided", "sequential")


@dataclass
class _Fragment:
    """Whole layers that sync together, and everything their outer step needs."""

    index: int
    offset: int  # syncs at the steps t with t % sync_every == offset
    names: list[str]
    params: list[torch.Tensor]  # the replica's parameters (DTensors under FSDP2)
    global_weights: list[torch.Tensor]  # float32, the local shape (shards under FSDP2)
    layout: list[Segment]  # over the fragment's flat outer gradient
    compressed: list[tuple[str, int, int]]  # (name, offset, numel) of compressed parameters
    outer: torch.optim.SGD
    numel: int


@dataclass
class _Sync:
    """A fragment's sync, from its start to the step its result is applied."""

    fragment: _Fragment
    due: int  # the step after which it is applied
    outer_gradient: torch.Tensor  # flat float32; the average once the work completed
    residual: torch.Tensor | None  # this rank's error feedback, updated by the collective
    work: Any  # the allreduce's Work; None once it completed


class DiLoCo:
    """Streaming DiLoCo on the inner optimizer of `model`.

    Args:
        model: the replica's model (plain, DDP- or FSDP2-wrapped); its parameters that
            `inner_optimizer` updates are synchronized, named as ``named_parameters()``.
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
    ) -> None:
        _check_arguments(model, inner_optimizer, sync_every, fragments, bits, bucket_size, policy, outer_lr,
                         outer_momentum, nesterov, overlap, mix, fragment_pattern)
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError("cgx.DiLoCo: the default process group does not exist yet: call "
                                   "torch.distributed.init_process_group first")
            group = dist.group.WORLD
        backend = get_backend(group)  # ValueError for a group that is not cgx's
        self.sync_every = sync_every
        self.overlap = overlap
        self.mix = float(mix)
        self.error_feedback = bool(error_feedback)
        self._group = group
        self._skip_incomplete = backend.settings.skip_incomplete_buckets
        self._backend = backend
        if policy is None:
            policy = CompressionPolicy(bits=bits, bucket_size=bucket_size or backend.settings.bucket_size,
                                       scheme=backend.settings.scheme.name,
                                       minimal_size=backend.settings.minimal_size)
        params = _synced_parameters(model, inner_optimizer)
        layers = _layers(params)
        if fragments > len(layers):
            raise ValueError(f"cgx.DiLoCo: fragments={fragments} is more than the model's "
                             f"{len(layers)} layers with parameters the optimizer updates")
        settings = policy.resolve(model)
        assignment = _assign(params, layers, fragments, fragment_pattern)
        self._fragments = [
            _fragment(p, p * sync_every // fragments, names, params, settings, outer_lr, outer_momentum, nesterov)
            for p, names in enumerate(assignment)
        ]
        difference = first_difference(group, {
            "sync_every": sync_every, "fragments": fragments, "fragment_pattern": fragment_pattern,
            "outer_lr": float(outer_lr), "outer_momentum": float(outer_momentum), "nesterov": bool(nesterov),
            "overlap": overlap, "mix": self.mix, "error_feedback": self.error_feedback,
            "fragments and layouts": [(f.names, f.layout) for f in self._fragments],
        })
        if difference:
            raise ValueError(f"cgx.DiLoCo: the ranks of the group were given different settings: "
                             f"{difference}; every replica must build DiLoCo alike on the same model")
        self.step = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self._in_flight: list[_Sync] = []
        self._stats = {"outer_syncs": 0, "bytes_sent": 0, "bytes_uncompressed": 0, "peak_bytes": 0,
                       "waits": 0, "wait_seconds": 0.0}
        self._start_from_rank_0()
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    # ---- the schedule

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        for sync in [s for s in self._in_flight if s.due == self.step]:
            self._finish(sync)
        for fragment in self._fragments:
            if self.step % self.sync_every == fragment.offset:
                sync = self._start(fragment)
                if self.overlap == 0:
                    self._finish(sync)

    def _start(self, fragment: _Fragment) -> _Sync:
        """Launches the allreduce of the fragment's outer gradient (global - local)."""
        with torch.no_grad():
            outer_gradient = torch.cat([(g - _local(p).float()).reshape(-1)
                                        for g, p in zip(fragment.global_weights, fragment.params)])
        residual = None
        if self.error_feedback and fragment.compressed:
            residual = torch.zeros_like(outer_gradient)
            for name, offset, numel in fragment.compressed:
                if name in self.residuals:
                    residual.narrow(0, offset, numel).copy_(self.residuals[name])
        if all(bits == RAW_BITS for _, _, bits, *_ in fragment.layout):
            with exact():  # Gloo's sum, then the division: exact DiLoCo
                work = dist.all_reduce(outer_gradient, op=dist.ReduceOp.AVG, group=self._group, async_op=True)
        else:
            work = self._backend.allreduce_layout(outer_gradient, fragment.layout, average=True,
                                                  residual=residual)
        sent = layout_bytes(fragment.layout, self._skip_incomplete)
        self._stats["bytes_sent"] += sent
        self._stats["bytes_uncompressed"] += 4 * fragment.numel
        self._stats["peak_bytes"] = max(self._stats["peak_bytes"], sent)
        sync = _Sync(fragment, self.step + self.overlap, outer_gradient, residual, work)
        self._in_flight.append(sync)
        return sync

    def _finish(self, sync: _Sync) -> None:
        """Waits for the sync's allreduce, then applies it: residuals, outer step, merge.
        A failed allreduce raises here and changes nothing (its sync is dropped)."""
        self._in_flight.remove(sync)
        if sync.work is not None:
            started = time.perf_counter()
            if self.overlap == 0 or not sync.work.is_completed():  # without overlap the step always waits
                self._stats["waits"] += 1
            sync.work.wait()
            sync.work = None
            self._stats["wait_seconds"] += time.perf_counter() - started
        fragment = sync.fragment
        if sync.residual is not None:
            for name, offset, numel in fragment.compressed:
                self.residuals[name] = sync.residual.narrow(0, offset, numel).clone()
        with torch.no_grad():
            offset = 0
            for g in fragment.global_weights:
                g.grad = sync.outer_gradient.narrow(0, offset, g.numel()).view_as(g)
                offset += g.numel()
            fragment.outer.step()
            for g, p in zip(fragment.global_weights, fragment.params):
                g.grad = None
                local = _local(p)
                local.copy_(g if self.overlap == 0 else torch.lerp(g, local.float(), self.mix))
        self._stats["outer_syncs"] += 1

    def _start_from_rank_0(self) -> None:
        """Every replica starts from group rank 0's weights, as DDP does."""
        globals_ = [g for f in self._fragments for g in f.global_weights]
        flat = torch.cat([g.reshape(-1) for g in globals_])
        dist.broadcast(flat, group_src=0, group=self._group)
        with torch.no_grad():
            offset = 0
            for fragment in self._fragments:
                for g, p in zip(fragment.global_weights, fragment.params):
                    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g))
                    _local(p).copy_(g)
                    offset += g.numel()

    # ---- lifetime

    def close(self) -> None:
        """Applies the syncs still in flight now and removes the hook from the optimizer."""
        self._hook.remove()
        for sync in list(self._in_flight):
            self._finish(sync)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # the step that raised left its state as it was; nothing more is applied
            self._hook.remove()
            self._in_flight.clear()

    # ---- stats and checkpoints

    def stats(self) -> dict[str, Any]:
        """This rank's totals: step, outer_syncs (fragment syncs applied), bytes_sent
        (payload this rank put into syncs) against bytes_uncompressed (float32),
        peak_bytes (the largest single sync), waits (syncs not yet complete when their
        result was due, and every sync without overlap: the inner loop waited on the link)
        and wait_seconds."""
        return {"step": self.step, **self._stats, "in_flight": len(self._in_flight)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: global weights, outer momentum, residuals, step, stats, and
        the syncs in flight (waited for, their averaged outer gradient kept, to be applied
        at their step after a resume). Checkpoint it with the model and the inner
        optimizer; every rank saves its own (residuals differ between ranks)."""
        for sync in self._in_flight:
            if sync.work is not None:
                sync.work.wait()
                sync.work = None
        return {
            "rank": dist.get_rank(self._group),
            "world_size": self._group.size(),
            "fragments": [f.names for f in self._fragments],
            "step": self.step,
            "global_weights": {n: g.clone() for f in self._fragments for n, g in zip(f.names, f.global_weights)},
            "outer_momentum": {n: f.outer.state[g]["momentum_buffer"].clone()
                               for f in self._fragments for n, g in zip(f.names, f.global_weights)
                               if f.outer.state[g].get("momentum_buffer") is not None},
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "in_flight": [{"fragment": s.fragment.index, "due": s.due, "outer_gradient": s.outer_gradient.clone(),
                           "residual": None if s.residual is None else s.residual.clone()}
                          for s in self._in_flight],
            "stats": dict(self._stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict() into a DiLoCo built as the saved one was (same
        model, fragments and group size); ValueError naming what differs otherwise.
        Residuals load only on the rank and group size that saved them: to resume at
        another size, load with ``state["residuals"] = {}`` and no sync in flight."""
        what = "cgx.DiLoCo.load_state_dict"
        missing = [k for k in _STATE_KEYS if k not in (state if isinstance(state, dict) else {})]
        if missing:
            raise ValueError(f"{what}: missing {missing} (expected the dict of DiLoCo.state_dict())")
        if state["fragments"] != [f.names for f in self._fragments]:
            raise ValueError(f"{what}: the state's fragments are not this DiLoCo's (another model, "
                             f"fragments or fragment_pattern)")
        if state["residuals"] or any(s["residual"] is not None for s in state["in_flight"]):
            check_same_place(state, dist.get_rank(self._group), self._group.size(), what)
        weights = {n: g for f in self._fragments for n, g in zip(f.names, f.global_weights)}
        for key in ("global_weights", "outer_momentum", "residuals"):
            for name, tensor in state[key].items():
                if name not in weights or tensor.shape != (
                        (weights[name].numel(),) if key == "residuals" else weights[name].shape):
                    raise ValueError(f"{what}: {key}[{name!r}] does not fit this model's parameter "
                                     f"(a checkpoint of another model or shard)")
        if set(state["global_weights"]) != set(weights):
            raise ValueError(f"{what}: global_weights lacks {sorted(set(weights) - set(state['global_weights']))}")
        for sync in self._in_flight:  # the replaced run's syncs: completed, not applied
            if sync.work is not None:
                sync.work.wait()
        with torch.no_grad():
            for fragment in self._fragments:
                for name, g in zip(fragment.names, fragment.global_weights):
                    g.copy_(state["global_weights"][name])
                    fragment.outer.state.pop(g, None)
                    if name in state["outer_momentum"]:
                        fragment.outer.state[g] = {"momentum_buffer": state["outer_momentum"][name].clone()}
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        self.step = int(state["step"])
        self._stats = dict(state["stats"])
        self._in_flight = [
            _Sync(self._fragments[s["fragment"]], s["due"], s["outer_gradient"].clone(),
                  None if s["residual"] is None else s["residual"].clone(), None)
            for s in state["in_flight"]
        ]


_STATE_KEYS = ("rank", "world_size", "fragments", "step", "global_weights", "outer_momentum", "residuals",
               "in_flight", "stats")


def _local(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: the local shard of an FSDP2 DTensor, else the
    parameter itself (in-place writes reach the parameter either way)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _synced_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's parameters the optimizer updates, by name, in model order; ValueError
    if the optimizer holds parameters that are not the model's, or none of them."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = {id(p): n for n, p in model.named_parameters()}
    strangers = owned - set(named)
    if strangers:
        raise ValueError(f"cgx.DiLoCo: inner_optimizer updates {len(strangers)} tensor(s) that are not "
                         f"parameters of the model: give the optimizer of this model's parameters")
    params = {n: p for n, p in model.named_parameters() if id(p) in owned and p.requires_grad}
    if not params:
        raise ValueError("cgx.DiLoCo: inner_optimizer updates none of the model's trainable parameters")
    return params


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


def _fragment(index: int, offset: int, names: list[str], params: dict[str, torch.Tensor],
              settings: dict[str, LayerSetting], outer_lr: float, outer_momentum: float,
              nesterov: bool) -> _Fragment:
    members = [params[n] for n in names]
    with torch.no_grad():
        global_weights = [_local(p).detach().float().clone() for p in members]
    layout: list[Segment] = []
    compressed = []
    cursor = 0
    for name, g in zip(names, global_weights):
        setting = settings[name]
        if setting.compressed and g.numel() > 0:
            compressed.append((name, cursor, g.numel()))
        append_segment(layout, cursor, g.numel(), setting)
        cursor += g.numel()
    outer = torch.optim.SGD(global_weights, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    return _Fragment(index, offset, names, members, global_weights, layout, compressed, outer, cursor)


def _check_arguments(model, optimizer, sync_every, fragments, bits, bucket_size, policy, outer_lr,
                     outer_momentum, nesterov, overlap, mix, fragment_pattern) -> None:
    what = "cgx.DiLoCo"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: inner_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for name, value, low in (("sync_every", sync_every, 1), ("fragments", fragments, 1), ("overlap", overlap, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{what}: {name} must be an integer >= {low}, got {value!r}")
    if fragments > sync_every:
        raise ValueError(f"{what}: fragments={fragments} is more than sync_every={sync_every} "
                         f"(fragments sync at distinct steps within sync_every)")
    if overlap >= sync_every:
        raise ValueError(f"{what}: overlap={overlap} must be less than sync_every={sync_every} "
                         f"(a fragment's sync must be applied before its next one starts)")
    if policy is not None:
        if not isinstance(policy, CompressionPolicy):
            raise TypeError(f"{what}: policy must be a cgx.CompressionPolicy, got {type(policy).__name__}")
        if bits != 4 or bucket_size is not None:
            raise ValueError(f"{what}: give either policy or bits / bucket_size, not both")
    check_bits(bits, what)
    if bucket_size is not None:
        check_bucket_size(bucket_size, what)
    if not isinstance(outer_lr, (int, float)) or not outer_lr > 0:
        raise ValueError(f"{what}: outer_lr must be > 0, got {outer_lr!r}")
    if not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise ValueError(f"{what}: outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if nesterov and outer_momentum == 0:
        raise ValueError(f"{what}: nesterov needs outer_momentum > 0")
    if not isinstance(mix, (int, float)) or not 0 <= mix <= 1:
        raise ValueError(f"{what}: mix must be in [0, 1], got {mix!r}")
    if fragment_pattern not in _PATTERNS:
        raise ValueError(f"{what}: fragment_pattern must be one of {_PATTERNS}, got {fragment_pattern!r}")
