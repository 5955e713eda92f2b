"""QSDP: compressed FSDP2 traffic — weight all-gathers and gradient reduce-scatters.

FSDP2 (``torch.distributed.fsdp.fully_shard``) gathers each unit's weights before its
forward and backward and reduce-scatters its gradients after backward. :func:`qsdp`
installs cgx comms on every unit through FSDP2's own extension points
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``)::

    import cgx
    dist.init_process_group("cgx")
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = cgx.qsdp(model, weight_bits=8, grad_bits=8)
    ...
    handle.stats()   # bytes sent vs uncompressed, per collective; units kept exact and why

Each unit's layout (which slice of the flat buffer FSDP2 hands the comm is which
parameter, and its bits and bucket size) is built from the unit's parameters once and
travels with every call into the backend (``allgather_layout`` /
``reduce_scatter_layout``). Only FSDP2's own traffic is compressed: ``full_tensor()``,
state dicts and any other collective on the group stay exact.

Weights: each rank quantizes its own shard once and every rank, the owner included,
decodes the same bytes, so the full weights are bit-identical everywhere; the optimizer
keeps updating the full-precision shard. Rounding is to nearest unless asked otherwise;
stochastic rounding is seeded by the unit and the content of the shard it gathers, so any
gather of the same weights (a re-gather in backward, an activation-checkpointing
recompute, a second forward before one backward) gets the same bytes, and autograd never
mixes two roundings of one set of weights. Gradients: each contribution is
quantized once with round-to-nearest and the owner sums them in float32; with
``error_feedback`` each rank keeps what quantization lost (a float32 buffer the size of
the unit's unsharded gradient) and adds it the next time.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from cgx.agreement import first_difference
from cgx.backend import get_backend, resolve_group
from cgx.config import is_int
from cgx.fsdp2_access import AllGather, ReduceScatter, UnitParameters, Unsupported, unit_parameters, unsupported
from cgx.layers import RAW_BITS, CompressionPolicy, LayerSetting, Segment, all_raw, append_segment, check_bits
from cgx.residuals import Residuals, check_same_place, place

__all__ = ["qsdp", "QSDP"]

_ROUNDINGS = ("stochastic", "nearest")
_KINDS = ("allgather", "reduce_scatter")


class _Unit:
    """One FSDP2 unit: its name, group, parameters' shard sizes and plans."""

    def __init__(self, index: int, name: str, module: FSDPModule, parameters: UnitParameters,
                 weight_settings: dict[int, LayerSetting], grad_settings: dict[int, LayerSetting]) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.group = parameters.group
        weights: list[Segment] = []
        grads: list[Segment] = []
        offset = 0
        for param, numel in parameters.shards:
            append_segment(weights, offset, numel, weight_settings[id(param)])
            append_segment(grads, offset, numel, grad_settings[id(param)])
            offset += numel
        self.shard_numel = offset
        self.plans = {"allgather": weights, "reduce_scatter": grads}

    def exact_reason(self, kind: str, tensor: torch.Tensor, numel: int, group: dist.ProcessGroup) -> str | None:
        """Why a call of this unit cannot take its plan (None: it can)."""
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return (f"FSDP2 gathers this unit as {tensor.dtype} (its parameters have mixed "
                    f"dtypes), so the values' boundaries are unknown")
        if group.size() < self.group.size():
            return (f"a backward re-gather over reshard_after_forward's group of {group.size()} "
                    f"ranks: it gathers weights the forward already decoded, so it stays exact "
                    f"for backward to compute with the forward's weights")
        if numel != self.shard_numel:
            return (f"the {kind} buffer holds {numel} elements per rank, the unit's parameter "
                    f"shards {self.shard_numel} (a tensor subclass with its own all-gather inputs?)")
        if all_raw(self.plans[kind]):
            return "no parameter of the unit is compressed by the policy"
        return None


class QSDP:
    """What :func:`qsdp` installed: per-rank error feedback (``residuals``: unit name ->
    float32 residual of the unit's unsharded gradient), the seed of stochastic weight
    rounding, and the traffic of its calls (:meth:`stats`)."""

    def __init__(self, units: list[_Unit], weight_rounding: str, error_feedback: bool, seed: int,
                 unsupported: str | None = None) -> None:
        self.units = units
        self.weight_rounding = weight_rounding
        self.error_feedback = error_feedback
        self.seed = seed
        self.unsupported = unsupported  # why nothing was installed (cgx.fsdp2_access)
        self.exact_units: dict[str, dict[str, str]] = {kind: {} for kind in _KINDS}
        self.residuals = Residuals()
        self._exact = {kind: {"calls": 0, "bytes": 0} for kind in _KINDS}

    def weight_seed(self, unit: _Unit, shard: torch.Tensor) -> int:
        """Stochastic rounding's seed for `unit`'s weights: a function of the weights
        themselves (the shard this rank gathers), so every gather of the same weights
        rounds them alike, and new weights round afresh."""
        content = int(torch.hash_tensor(shard).view(torch.int64))
        digest = hashlib.blake2b(f"{self.seed}/{unit.name}/{content}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def _exact_call(self, kind: str, unit: _Unit, reason: str, nbytes: int) -> None:
        self.exact_units[kind].setdefault(unit.name, reason)
        self._exact[kind]["calls"] += 1
        self._exact[kind]["bytes"] += nbytes

    def stats(self) -> dict[str, Any]:
        """This rank's traffic per collective (docs/stats.md): compressed calls, bytes_sent
        and uncompressed_bytes (the backend's, over the groups the units use), calls kept
        exact and their bytes, which units stayed exact and why, and ``unsupported``: why
        cgx installed nothing on this torch (None where it did)."""
        groups = {id(u.group): u.group for u in self.units}.values()
        per_group = [get_backend(g).stats() for g in groups]
        out: dict[str, Any] = {}
        for kind in _KINDS:
            counters = {key: sum(s[kind][key] for s in per_group)
                        for key in ("calls", "bytes_sent", "uncompressed_bytes")}
            counters["exact_calls"] = self._exact[kind]["calls"]
            counters["exact_bytes"] = self._exact[kind]["bytes"]
            out[kind] = counters
        out["exact_units"] = {kind: dict(units) for kind, units in self.exact_units.items()}
        out["unsupported"] = self.unsupported
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals, with what they depend on: the rank (global:
        the units may shard over groups of several sizes, and HSDP's replicas hold the same
        rank of their shard groups) and the world size, and each unit's gradient layout
        (they differ between ranks: every rank saves and loads its own)."""
        return {**place(resolve_group(None, "cgx.QSDP.state_dict")),
                "layouts": {u.name: [list(s) for s in u.plans["reduce_scatter"]] for u in self.units},
                "residuals": self.residuals.cloned()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict(); ValueError naming what differs for a state saved
        on another rank, at another world size, or for units sharded otherwise."""
        what = "cgx.QSDP.load_state_dict"
        missing = [k for k in ("rank", "world_size", "layouts", "residuals") if k not in state]
        if missing:
            raise ValueError(f"{what}: missing {missing} (expected the dict of QSDP.state_dict())")
        by_name = {u.name: u for u in self.units}
        unknown = set(state["residuals"]) - set(by_name)
        if unknown:
            raise ValueError(f"{what}: no unit named {sorted(unknown)} in this model")
        if state["residuals"]:
            check_same_place(state, place(resolve_group(None, what)), what)
        for name, residual in state["residuals"].items():
            unit = by_name[name]
            saved = [tuple(s) for s in state["layouts"].get(name, ())]
            if saved != unit.plans["reduce_scatter"]:
                raise ValueError(
                    f"{what}: unit {name!r} lays out its gradient shard otherwise than when the "
                    f"state was saved (another model, policy or sharding): saved "
                    f"{_describe(saved)}, now {_describe(unit.plans['reduce_scatter'])}")
            expected = unit.shard_numel * unit.group.size()
            if residual.numel() != expected:
                raise ValueError(f"{what}: the residual of unit {name!r} has "
                                 f"{residual.numel()} elements, the unit's gradients {expected}")
        self.residuals = Residuals({n: r.to(torch.float32).clone() for n, r in state["residuals"].items()})


def _describe(plan: list[Segment]) -> str:
    """A plan in a few words, for an error message."""
    if not plan:
        return "no segments"
    numel = sum(n for _, n, *_ in plan)
    shown = ", ".join(f"({o}, {n}, {b}, {k}{''.join(', ' + x for x in s if x != 'maxmin')})"
                      for o, n, b, k, *s in plan[:3])
    return f"{len(plan)} segments over {numel} elements [{shown}{', ...' if len(plan) > 3 else ''}]"


class _Comm:
    def __init__(self, handle: QSDP, unit: _Unit) -> None:
        self.handle = handle
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _returned(work, async_op: bool):
    """What FSDP2 expects back from a comm: the Work when async, else None once done."""
    if async_op:
        return work
    work.wait()
    return None


class _AllGather(_Comm, AllGather):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        unit, handle = self.unit, self.handle
        reason = unit.exact_reason("allgather", input_tensor, input_tensor.numel(), group)
        if reason:
            handle._exact_call("allgather", unit, reason, input_tensor.nbytes * (group.size() - 1))
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        stochastic = handle.weight_rounding == "stochastic"
        work = get_backend(group).allgather_layout(
            output_tensor, input_tensor, unit.plans["allgather"],
            stochastic=stochastic, seed=handle.weight_seed(unit, input_tensor) if stochastic else 0)
        return _returned(work, async_op)


class _ReduceScatter(_Comm, ReduceScatter):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):
        unit, handle = self.unit, self.handle
        kind = getattr(op, "op", op)  # a ReduceOp (PREMUL_SUM carries its factor) or its type
        reason = unit.exact_reason("reduce_scatter", input_tensor, input_tensor.numel() // group.size(), group)
        if reason is None and kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM):
            reason = f"FSDP2 asked for {kind}, not SUM, AVG or PREMUL_SUM"
        if reason:
            handle._exact_call("reduce_scatter", unit, reason, input_tensor.nbytes * (group.size() - 1) // group.size())
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        residual = None
        if handle.error_feedback:
            residual = handle.residuals.get(unit.name)
            if residual is None:
                residual = handle.residuals[unit.name] = torch.zeros(
                    input_tensor.numel(), dtype=torch.float32, device=input_tensor.device)
        name = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PREMUL_SUM: "premul_sum"}[kind]
        factor = float(op.factor) if kind == dist.ReduceOp.PREMUL_SUM else 1.0
        work = get_backend(group).reduce_scatter_layout(
            output_tensor, input_tensor, unit.plans["reduce_scatter"], op=name, factor=factor,
            residual=residual)
        return _returned(work, async_op)


def qsdp(
    module: torch.nn.Module,
    weight_bits: int = 8,
    grad_bits: int = 8,
    *,
    policy: CompressionPolicy | None = None,
    weight_rounding: str = "nearest",
    error_feedback: bool = False,
    seed: int = 0,
) -> QSDP:
    """Compresses the weight all-gathers and gradient reduce-scatters of every FSDP2 unit
    in `module` (call after ``fully_shard``; the units' groups must be cgx groups).

    Args:
        weight_bits: bits of the gathered weights (1..8; 32 leaves the all-gather exact).
        grad_bits: bits of the reduce-scattered gradients (1..8; 32 leaves it exact).
        policy: which parameters are compressed, and with what bucket size
            (:class:`cgx.CompressionPolicy`): a parameter it leaves raw (1-D parameters,
            layers at or under its minimal size, rules with bits=32) stays exact in both
            directions; the others take weight_bits / grad_bits. Default:
            ``CompressionPolicy()`` (bucket size 512).
        weight_rounding: "nearest" (the default: measured better, docs/fsdp.md) or
            "stochastic" (unbiased, QSDP's condition for its convergence guarantee).
        error_feedback: keep each rank's gradient quantization residual and add it the next
            step (memory: a float32 unsharded gradient per unit).
        seed: mixed into the weights' stochastic rounding.

    Every rank of each unit's group must call it alike: the arguments and the units'
    layouts are compared over the group (one small all-gather), and a difference raises
    ValueError on every rank naming it.

    On a torch outside the releases cgx's FSDP2 adapter was checked against
    (``cgx.fsdp2_access.CHECKED_TORCH``) it installs nothing: FSDP2's traffic stays exact,
    a warning says why, and so does ``stats()["unsupported"]``.
    """
    _check_arguments(weight_bits, grad_bits, weight_rounding, seed, policy)
    fsdp_units = [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_units:
        raise ValueError(
            f"cgx.qsdp: {type(module).__name__} has no FSDP2 unit: call "
            f"torch.distributed.fsdp.fully_shard on its blocks and on it first")
    policy = policy or CompressionPolicy()
    policy.resolve(module)  # refuses rules that match nothing
    reason = unsupported()
    parameters_of = {}
    if reason is None:
        try:
            parameters_of = {name: unit_parameters(m) for name, m in fsdp_units}
        except Unsupported as e:
            reason = str(e)
    if reason:
        warnings.warn(f"cgx.qsdp: {reason}", RuntimeWarning, stacklevel=2)
        handle = QSDP([], weight_rounding, error_feedback, seed, unsupported=reason)
        for kind in _KINDS:
            handle.exact_units[kind] = {name: reason for name, _ in fsdp_units}
        return handle
    units = _units(module, fsdp_units, parameters_of, _every_parameters_setting(module, policy, weight_bits),
                   _every_parameters_setting(module, policy, grad_bits))
    _agree(units, {"weight_bits": weight_bits, "grad_bits": grad_bits, "weight_rounding": weight_rounding,
                   "error_feedback": bool(error_feedback), "seed": seed})
    handle = QSDP(units, weight_rounding, error_feedback, seed)
    for unit in units:
        if weight_bits != RAW_BITS:
            unit.module.set_custom_all_gather(_AllGather(handle, unit))
        if grad_bits != RAW_BITS:
            unit.module.set_custom_reduce_scatter(_ReduceScatter(handle, unit))
    return handle


def _check_arguments(weight_bits: int, grad_bits: int, weight_rounding: str, seed: int,
                     policy: CompressionPolicy | None) -> None:
    check_bits(weight_bits, "cgx.qsdp weight_bits")
    check_bits(grad_bits, "cgx.qsdp grad_bits")
    if weight_rounding not in _ROUNDINGS:
        raise ValueError(f"cgx.qsdp: weight_rounding must be one of {_ROUNDINGS}, got {weight_rounding!r}")
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"cgx.qsdp: seed must be an integer in 0..2**63-1, got {seed!r}")
    if policy is not None and not isinstance(policy, CompressionPolicy):
        raise TypeError(f"cgx.qsdp: policy must be a cgx.CompressionPolicy, got {type(policy).__name__}")


def _every_parameters_setting(module: torch.nn.Module, policy: CompressionPolicy,
                              bits: int) -> dict[int, LayerSetting]:
    """id(parameter) -> its setting at `bits`, for every parameter of `module` (the frozen
    ones are gathered too)."""
    owners = {id(p): m for m in module.modules() for p in m.parameters(recurse=False)}
    return {id(param): policy.setting_for(name, owners[id(param)], param, bits)
            for name, param in module.named_parameters()}


def _units(module: torch.nn.Module, fsdp_units: list, parameters_of: dict,
           weight_settings: dict[int, LayerSetting], grad_settings: dict[int, LayerSetting]) -> list[_Unit]:
    """The units that manage parameters, each on a cgx group (ValueError naming the unit
    otherwise)."""
    units = []
    for index, (name, unit_module) in enumerate(fsdp_units):
        parameters = parameters_of[name]
        if parameters is None:
            continue  # a unit that manages no parameter moves nothing
        unit = _Unit(index, name, unit_module, parameters, weight_settings, grad_settings)
        try:
            get_backend(unit.group)
        except ValueError as e:
            raise ValueError(f"cgx.qsdp: FSDP2 unit {unit.name!r} shards over a group that is not cgx's: {e}") from None
        units.append(unit)
    return units


def _agree(units: list[_Unit], arguments: dict[str, object]) -> None:
    """Ranks that install different comms (8 bits on one, 32 on another) would meet only at
    the timeout, in mismatched collectives: compare the arguments and the units' layouts
    over each group the units shard over, now, and raise on every rank naming the first
    difference."""
    fields = {**arguments, "units and layouts": [(u.name, u.plans) for u in units]}
    for group in {id(u.group): u.group for u in units}.values():
        difference = first_difference(group, fields)
        if difference:
            raise ValueError(f"cgx.qsdp: the ranks of a unit's group called qsdp differently: "
                             f"{difference}; every rank must call cgx.qsdp with the same arguments "
                             f"on the same model")
