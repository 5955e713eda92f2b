"""The cgx DDP communication hook and its state.

Example::

    import cgx, torch.distributed as dist
    dist.init_process_group("cgx")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4), warmup_steps=100)
    ddp.register_comm_hook(state, cgx.cgx_hook)

torch_cgx's form works unchanged. Without a model, the state finds the module of the
DDP it serves on its first call, so layers are named by their parameters' names either
way (never by DDP's buckets, which static_graph, find_unused_parameters and
bucket_cap_mb lay out differently)::

    state = cgx.CGXState(dist.group.WORLD, layer_min_size=1024,
                         compression_params={"bits": 4, "bucket_size": 1024})
    ddp.register_comm_hook(state, cgx.cgx_hook)

A state can be made before ``init_process_group`` (as PyTorch Lightning's
``DDPStrategy(ddp_comm_state=...)`` does): the group and its defaults are read on the
first call.

Each bucket is averaged with one ``allreduce_layout`` call on the "cgx" group: the
bucket's per-layer plan (which slice is which parameter, with its bits and bucket size)
travels with the call, so other allreduces on the same group in between (metrics, loss
averaging, a distributed loss) cannot disturb it.

Error feedback keeps, per compressed parameter, what quantization dropped and adds it to
the next step's gradient. By default it is on for layers compressed at
FEEDBACK_MAX_BITS (2) bits or fewer and off above: measured on three tasks and three
seeds (docs/error-feedback.md), it helped at 2 bits where the error is large, and at 3-4
bits moved the loss a point or two either way depending on the task. Two-level (the default form) feeds back both stages:
the collective records, on each rank, what every quantization that rank made dropped:
its own contributions, and the sums it re-quantized as a chunk's owner (or a ring hop).
The ranks' residuals then add up to exactly what the averaged gradient lacked, so over
steps nothing is lost, whoever owned which chunk (docs/error-feedback.md). It costs one
float32 per compressed gradient element, kept per parameter name. ``two_level=False``
feeds back the first stage only, estimated locally (``g - Q(g)``, one extra local
compress/decompress per step); that form needs round-to-nearest.
"""


# No `from __future__ import annotations` here: DDP checks cgx_hook's annotations as
# objects (dist.GradBucket), not strings.
import copy
import gc
import warnings
from typing import Any

import torch
import torch.distributed as dist

from cgx import _C
from cgx.adaptive import AdaptiveBits
from cgx.backend import get_backend, resolve_group
from cgx.config import check_int
from cgx.counters import RENAMED, Stats, count_exact, no_exact, warn_renamed
from cgx.layers import (RAW_BITS, SCHEMES, CompressionPolicy, LayerSetting, all_raw, bucket_plan, check_bits,
                        check_bucket_size, check_setting, layout_bytes)
from cgx.residuals import Residuals, check_same_place, place

__all__ = ["CGXState", "cgx_hook"]

# Layers compressed at this many bits or fewer get error feedback unless the state says
# otherwise (error_feedback=True or False).
FEEDBACK_MAX_BITS = 2


class CGXState:
    """State of :func:`cgx_hook`: the policy, error-feedback residuals, warm-up, stats.

    The state holds what the hook needs from one call to the next and what a checkpoint
    saves; the hook does the work (as torch's ``PowerSGDState`` and ``powerSGD_hook``).

    Args:
        process_group: a "cgx" group, or None for the default group (which need not
            exist yet: it is looked up on the hook's first call).
        model: the module wrapped by DDP (its parameter names key the policy and the
            residuals). None: the module of the DDP the hook is registered on, found on
            the first call; the same names either way.
        policy: per-layer settings; None takes bits, bucket size and minimal size from
            the group's settings (the CGX_* variables or its ``pg_options``).
        layer_min_size, compression_params: torch_cgx's way to say the policy, instead
            of ``policy``: layers with 2+ dimensions and at least ``layer_min_size``
            elements (and more than the group's minimal size) are compressed with
            ``compression_params["bits"]`` and ``["bucket_size"]`` (each defaulting to
            the group's setting).
        error_feedback: keep and re-add each layer's quantization residual: True for
            every compressed layer, False for none, None (the default) for the layers
            compressed at ``FEEDBACK_MAX_BITS`` (2) bits or fewer, whatever their
            setting is at the time (an adaptive plan may move a layer across; it then
            starts or drops its residual).
        two_level: with error_feedback, feed back the owners' re-quantization of the sums
            too, as the collective measures it (both stages); False: each rank's own
            quantization only, estimated locally.
        warmup_steps: the first steps are reduced uncompressed (an all-raw plan).
        stats_every: every this many steps, measure each compressed layer's relative
            quantization error ``|Q(g) - g| / |g|`` (0 turns the sampling off).
        adaptive: a :class:`cgx.AdaptiveBits` that re-chooses the compressed layers'
            settings periodically (L-GreCo); None keeps the policy's.
    """

    __slots__ = (
        # hyper-parameters
        "process_group",
        "policy",
        "error_feedback",
        "two_level",
        "warmup_steps",
        "stats_every",
        "adaptive",
        "_torch_cgx",  # (layer_min_size, compression_params) until the group resolves them
        # wiring to the model (not pickled: found again, or given to attach())
        "_model",
        "_params",
        "_settings_by_param",
        "_reduced",  # ids of the parameters reduced since the last step ended
        # internal state, checkpointed
        "step",
        "residuals",
        "layer_settings",
        # stats (docs/stats.md)
        "payload_bytes",
        "uncompressed_payload_bytes",
        "exact",  # calls sent the exact way, and why (no_exact()'s keys)
        "layer_errors",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        model: torch.nn.Module | None = None,
        policy: CompressionPolicy | None = None,
        *,
        layer_min_size: int | None = None,
        compression_params: dict[str, int] | None = None,
        error_feedback: bool | None = None,
        two_level: bool = True,
        warmup_steps: int = 0,
        stats_every: int = 10,
        adaptive: AdaptiveBits | None = None,
    ) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"cgx.CGXState: model must be a torch.nn.Module or None, got "
                f"{type(model).__name__} (torch_cgx's layer_min_size goes by keyword: "
                f"CGXState(group, layer_min_size={model!r}))"
            )
        check_int(warmup_steps, "warmup_steps", "cgx.CGXState")
        check_int(stats_every, "stats_every", "cgx.CGXState")
        torch_cgx_form = layer_min_size is not None or compression_params is not None
        if policy is not None and torch_cgx_form:
            raise ValueError(
                "cgx.CGXState: give either policy or torch_cgx's layer_min_size / "
                "compression_params, not both"
            )
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"cgx.CGXState: error_feedback must be True, False or None, got {error_feedback!r}")
        self.process_group = process_group
        self.policy = policy
        self._torch_cgx = _torch_cgx_args(layer_min_size, compression_params) if torch_cgx_form else None
        self.error_feedback = error_feedback
        self.two_level = bool(two_level)
        self.warmup_steps = warmup_steps
        self.stats_every = stats_every
        self.adaptive = adaptive
        self.step = 0
        self.residuals = Residuals()
        self.payload_bytes = 0
        self.uncompressed_payload_bytes = 0
        self.exact = no_exact()
        self.layer_errors: dict[str, float] = {}
        self.layer_settings: dict[str, LayerSetting] = {}
        self._model: torch.nn.Module | None = None
        self._params: dict[str, torch.Tensor] = {}  # the layers by name
        self._settings_by_param: dict[int, tuple[str, LayerSetting]] = {}
        self._reduced: set[int] = set()
        # The group's defaults are read now where the group exists, else on first use.
        if self.policy is None and (process_group is not None or dist.is_initialized()):
            self._resolve_policy()
        if model is not None:
            self.attach(model)

    # ---- the group, the policy and the model

    def group(self) -> dist.ProcessGroup:
        """The process group the hook reduces on (the default group when None)."""
        return resolve_group(self.process_group, "cgx.CGXState",
                             "before the first backward (the state itself may be made before)")

    def _resolve_policy(self) -> None:
        """The policy from the group's settings (and torch_cgx's arguments, if given)."""
        settings = get_backend(self.group()).settings
        if self._torch_cgx is None:
            self.policy = CompressionPolicy.from_settings(settings)
            return
        layer_min_size, params = self._torch_cgx
        self.policy = CompressionPolicy.from_settings(
            settings, bits=params.get("bits"), bucket_size=params.get("bucket_size"),
            # torch_cgx compresses numel >= layer_min_size; the policy keeps numel <= minimal_size raw.
            minimal_size=max(layer_min_size - 1, settings.minimal_size))

    def attach(self, model: torch.nn.Module) -> None:
        """Resolves the policy on `model`, the module DDP wraps (after unpickling, or to
        move the state to another DDP of the same model). Without a call to attach the
        hook finds the module itself on its first call. Refuses a model whose layers are
        not the ones the state's loaded settings and residuals belong to."""
        self._model = model
        if self.policy is None:
            return  # before the process group exists: resolved on the hook's first call
        resolved = self.policy.resolve(model)
        params = {n: p for n, p in model.named_parameters() if n in resolved}
        _check_fits(self.layer_settings, self.residuals, params, "cgx.CGXState.attach")
        # Settings chosen later (adaptive selection, a loaded checkpoint) stay.
        self.layer_settings = {**resolved, **self.layer_settings}
        self._params = params
        self._rewire()

    def _bind(self, bucket: dist.GradBucket) -> None:
        """On the hook's first call: the group's defaults, and the model if none was given."""
        if self.policy is None:
            self._resolve_policy()
        if not self._settings_by_param:
            self.attach(self._model if self._model is not None else _module_wrapped_by_ddp(bucket))

    def set_layer_settings(self, settings: dict[str, LayerSetting]) -> None:
        """Replaces the settings of the named layers (e.g. from adaptive selection). Before
        the model is known, they are checked against it when it is."""
        unknown = set(settings) - set(self.layer_settings)
        if unknown and self._settings_by_param:
            raise ValueError(f"cgx.CGXState: unknown layers {sorted(unknown)}")
        self.layer_settings.update(settings)
        self._rewire()

    def _rewire(self) -> None:
        self._settings_by_param = {
            id(p): (n, self.layer_settings[n]) for n, p in self._params.items()
        }
        drifting = sorted(n for n, p in self._params.items()
                          if _one_bit_maxmin(self.layer_settings[n], p.numel())
                          and self.feeds_back(self.layer_settings[n]))
        if drifting:
            warnings.warn(
                f"cgx.CGXState: {drifting[:4]}{' ...' if len(drifting) > 4 else ''} quantize values in maxmin "
                f"buckets at 1 bit with error feedback, which does not converge (the residuals grow "
                f"without bound; a hadamard layer's shorter last bucket is maxmin): use 2 bits or more, "
                f"hadamard with layer sizes a multiple of the bucket, or error_feedback=False "
                f"(docs/error-feedback.md)", RuntimeWarning, stacklevel=3)

    def feeds_back(self, setting: LayerSetting) -> bool:
        """Whether a layer compressed with `setting` keeps an error-feedback residual."""
        if self.error_feedback is None:
            return setting.bits <= FEEDBACK_MAX_BITS
        return self.error_feedback

    # ---- stats and checkpoints

    def stats(self) -> dict[str, Any]:
        """This rank's totals (docs/stats.md): step, payload_bytes (what it handed to the
        allreduces: compressed, or float32 where sent exactly) against
        uncompressed_payload_bytes (the buckets in their dtype), compression_ratio,
        exact_calls, exact_bytes and exact_why: the bucket allreduces sent the exact way,
        their payload, and why ('warmup', 'auto': CGX_COMPRESSION_AUTO timed it faster,
        'policy': every layer of the bucket exact, 'sparse': sparse gradients), and
        layer_errors: each compressed layer's last sampled relative quantization error."""
        return Stats({
            "step": self.step,
            "payload_bytes": self.payload_bytes,
            "uncompressed_payload_bytes": self.uncompressed_payload_bytes,
            "compression_ratio": self.uncompressed_payload_bytes / max(1, self.payload_bytes),
            **copy.deepcopy(self.exact),
            "layer_errors": dict(self.layer_errors),
        })

    def compression_stats(self) -> dict[str, Any]:
        """Deprecated name of :meth:`stats`."""
        warn_renamed("CGXState.compression_stats()", "CGXState.stats()")
        return self.stats()

    @property
    def bytes_sent(self) -> int:
        """Deprecated name of ``payload_bytes``."""
        warn_renamed("CGXState.bytes_sent", "CGXState.payload_bytes")
        return self.payload_bytes

    @property
    def bytes_uncompressed(self) -> int:
        """Deprecated name of ``uncompressed_payload_bytes``."""
        warn_renamed("CGXState.bytes_uncompressed", "CGXState.uncompressed_payload_bytes")
        return self.uncompressed_payload_bytes

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: residuals (and adaptive statistics) differ between ranks, so
        every rank saves and loads its own."""
        return {
            **(place(self.group()) if dist.is_initialized() else {"rank": None, "world_size": None}),
            "step": self.step,
            "residuals": self.residuals.cloned(),
            "layer_settings": {n: (s.bits, s.bucket_size, s.scheme) for n, s in self.layer_settings.items()},
            "adaptive_accumulated": (
                {n: g.clone() for n, g in self.adaptive.accumulated.items()} if self.adaptive else {}
            ),
            "payload_bytes": self.payload_bytes,
            "uncompressed_payload_bytes": self.uncompressed_payload_bytes,
            "exact": copy.deepcopy(self.exact),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict() (also one saved before the stats' names changed);
        ValueError naming the key for anything else. Before the model is known (a state
        made without one, not yet called), what depends on it is checked on the hook's
        first call."""
        state = _check_state_dict(state)
        if self._settings_by_param:
            _check_fits(state["layer_settings"], state["residuals"], self._params, "cgx.CGXState.load_state_dict")
        if state["residuals"] and dist.is_initialized():
            check_same_place(state, place(self.group()), "cgx.CGXState.load_state_dict")
        if self.adaptive:
            self.adaptive.accumulated = {n: g.clone() for n, g in state["adaptive_accumulated"].items()}
        self.step = int(state["step"])
        self.residuals = Residuals({n: r.clone() for n, r in state["residuals"].items()})
        self.payload_bytes = int(state["payload_bytes"])
        self.uncompressed_payload_bytes = int(state["uncompressed_payload_bytes"])
        self.exact = copy.deepcopy(state.get("exact", no_exact()))  # (a state saved before it was counted: none)
        self.set_layer_settings({n: LayerSetting(*s) for n, s in state["layer_settings"].items()})

    def __getstate__(self) -> dict[str, Any]:
        # The process group and the wiring to the model do not survive pickling.
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in _UNPICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self._model = None
        self._params = {}
        self._settings_by_param = {}
        self._reduced = set()
        self.two_level = True  # a state pickled before two-level feedback existed
        self._torch_cgx = None
        self.exact = no_exact()  # a state pickled before it was counted
        for slot, value in state.items():
            slot = RENAMED.get(slot, slot)  # a state pickled before the stats' names changed
            if slot in self.__slots__:  # older pickles hold slots since removed
                setattr(self, slot, value)
        self.residuals = Residuals(self.residuals)


_STATE_KEYS = ("rank", "world_size", "step", "residuals", "layer_settings", "adaptive_accumulated",
               "payload_bytes", "uncompressed_payload_bytes")


_UNPICKLED = ("process_group", "_model", "_params", "_settings_by_param", "_reduced")


def _check_state_dict(state: Any) -> dict[str, Any]:
    """What CGXState.load_state_dict accepts: a dict of state_dict()'s form (older names
    taken as the new), with valid settings and float residuals (whether they fit the
    model: _check_fits). Returns it under the current names."""
    what = "cgx.CGXState.load_state_dict"
    if not isinstance(state, dict):
        raise TypeError(f"{what}: expected the dict of CGXState.state_dict(), got {type(state).__name__}")
    older = {k: new for k, new in RENAMED.items() if k in state and new not in state}
    state = {older.get(k, k): v for k, v in state.items()}
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"{what}: missing {missing} (expected the dict of CGXState.state_dict())")
    for key in ("step", "payload_bytes", "uncompressed_payload_bytes"):
        check_int(state[key], repr(key), what)
    for name, setting in state["layer_settings"].items():
        # (bits, bucket_size) from before schemes existed is maxmin.
        if not (isinstance(setting, (tuple, list)) and len(setting) in (2, 3)):
            raise ValueError(f"{what}: layer_settings[{name!r}] must be (bits, bucket_size, scheme), "
                             f"got {setting!r}")
        check_bits(setting[0], f"{what}: layer_settings[{name!r}]")
        check_bucket_size(setting[1], f"{what}: layer_settings[{name!r}]")
        check_setting(*setting[:2], setting[2] if len(setting) == 3 else "maxmin",
                      f"{what}: layer_settings[{name!r}]")
    for key in ("residuals", "adaptive_accumulated"):
        for name, tensor in state[key].items():
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                raise ValueError(f"{what}: {key}[{name!r}] must be a float tensor, got {tensor!r}")
    return state


def _one_bit_maxmin(setting: LayerSetting, numel: int) -> bool:
    """Whether a layer of `numel` values in `setting` has maxmin buckets at 1 bit."""
    return setting.bits == 1 and (setting.scheme == "maxmin" or numel % setting.bucket_size != 0)


def _check_fits(layer_settings: dict, residuals: dict[str, torch.Tensor],
                params: dict[str, torch.Tensor], what: str) -> None:
    """Settings and residuals (loaded, or kept from before) name the model's layers and
    fit them; else ValueError naming the first that does not."""
    unknown = sorted((set(layer_settings) | set(residuals)) - set(params))
    if unknown:
        raise ValueError(
            f"{what}: the state names layers the model does not have ({unknown[:4]}"
            f"{' ...' if len(unknown) > 4 else ''}; the model's look like "
            f"{next(iter(params), '<none>')!r}): the state is another model's"
        )
    for name, residual in residuals.items():
        if residual.numel() != params[name].numel():
            raise ValueError(
                f"{what}: residuals[{name!r}] has {residual.numel()} values, the layer "
                f"{params[name].numel()}: the state is another model's"
            )


def _module_wrapped_by_ddp(bucket: dist.GradBucket) -> torch.nn.Module:
    """The module of the DistributedDataParallel this bucket is from, for a state made
    without one: looked up once among the live DDP objects, by the bucket's parameters
    (the hook receives the bucket only)."""
    from torch.nn.parallel import DistributedDataParallel

    param = bucket.parameters()[0]
    modules = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): a dead weakref proxy raises on __class__.
        if issubclass(type(obj), DistributedDataParallel) and any(p is param for p in obj.module.parameters()):
            modules[id(obj.module)] = obj.module
    if len(modules) != 1:
        raise RuntimeError(
            f"cgx_hook: {'no' if not modules else f'{len(modules)} different'} modules wrapped by "
            f"DistributedDataParallel hold the parameters of this bucket, so the CGXState "
            f"cannot name its layers: give it the module, cgx.CGXState(group, model, ...)"
        )
    return next(iter(modules.values()))


_TORCH_CGX_PARAMS = ("bits", "bucket_size")


def _torch_cgx_args(layer_min_size: int | None,
                    compression_params: dict[str, int] | None) -> tuple[int, dict[str, int]]:
    """torch_cgx's CGXState arguments, checked (the group fills in the rest, with
    torch_cgx's meaning: compress layers of 2+ dimensions with at least `layer_min_size`
    elements, default 1024, and more than the group's minimal size)."""
    params = dict(compression_params or {})
    unknown = set(params) - set(_TORCH_CGX_PARAMS)
    if unknown:
        raise ValueError(
            f"cgx.CGXState: unknown compression_params {sorted(unknown)} "
            f"(torch_cgx's are {list(_TORCH_CGX_PARAMS)})"
        )
    if "bits" in params:
        check_bits(params["bits"], "cgx.CGXState compression_params")
    if "bucket_size" in params:
        check_bucket_size(params["bucket_size"], "cgx.CGXState compression_params")
    if layer_min_size is None:
        layer_min_size = 1024
    check_int(layer_min_size, "layer_min_size", "cgx.CGXState")
    return layer_min_size, params


# ---- the hook: the work, on the state


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages a DDP bucket with per-layer compression. Register with
    ``ddp.register_comm_hook(state, cgx.cgx_hook)``."""
    group = state.group()
    state._bind(bucket)
    backend = get_backend(group)
    if state.error_feedback is not False and not state.two_level and backend.settings.stochastic_rounding:
        raise ValueError(
            "cgx_hook: one-level error feedback (two_level=False) estimates the residual "
            "with round-to-nearest, but the group rounds stochastically "
            "(CGX_COMPRESSION_STOCHASTIC_ROUNDING): create the CGXState with two_level=True "
            "or error_feedback=False"
        )
    # DDP does not always say which bucket is a step's last (static_graph's first
    # iteration on some torch versions calls every bucket index 0, none last): a bucket
    # whose parameters were already reduced in this step starts the next one.
    ids = [id(p) for p in bucket.parameters()]
    if not state._reduced.isdisjoint(ids) and _close_step(state):
        _replan(state, group)
    state._reduced.update(ids)
    buffer = bucket.buffer()
    buffer.div_(group.size())  # divide first, as torch's hooks do (no fp16 overflow)
    if buffer.is_sparse:  # nn.Embedding(sparse=True): reduced exactly, as without a hook
        sent = buffer._indices().nbytes + buffer._values().nbytes  # Gloo gathers both
        state.payload_bytes += sent
        state.uncompressed_payload_bytes += sent
        count_exact(state.exact, "sparse", sent)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    else:
        future = _reduce_dense(state, bucket, group, backend)
    if bucket.is_last() and _close_step(state):
        _replan(state, group)
    return future.then(lambda f: f.value()[0])


def _reduce_dense(state: CGXState, bucket: dist.GradBucket, group: dist.ProcessGroup,
                  backend: _C.ProcessGroupCGX) -> torch.futures.Future:
    """One allreduce_layout of the (divided) bucket with its plan, the residuals of the
    layers fed back laid into the call; the future keeps the new residuals and counts
    the payload once the call completed."""
    settings = backend.settings
    buffer = bucket.buffer()
    residual, compressed, fed = None, [], []
    warmup = state.step < state.warmup_steps
    if warmup:
        layout = [(0, buffer.numel(), RAW_BITS, 1, "maxmin")]
    else:
        layout, compressed = bucket_plan(bucket, state._settings_by_param)
        fed = _layers_with_feedback(state, compressed)
        _inspect_and_feed_back_locally(state, buffer, compressed, settings, decides=group.rank() == 0)
        if state.two_level and fed:
            residual = state.residuals.gather(buffer.numel(), fed, buffer.device)
    work = backend.allreduce_layout(buffer, layout, residual=residual)

    def settle(done):
        result = done.value()  # a failed call raises here and keeps the old residuals
        if residual is not None:
            state.residuals.keep(residual, fed)
        state.uncompressed_payload_bytes += buffer.numel() * buffer.element_size()
        sent_exactly = _C.sent_exactly(work)
        payload = layout_bytes(layout, settings.skip_incomplete_buckets, sent_exactly)
        state.payload_bytes += payload
        if warmup or sent_exactly or all_raw(layout):
            count_exact(state.exact, "warmup" if warmup else "auto" if sent_exactly else "policy", payload)
        return result
    return work.get_future().then(settle)


def _close_step(state: CGXState) -> bool:
    """Counts the step that ended; True where the adaptive plan is due after it (the
    caller then re-plans, a collective)."""
    state._reduced.clear()
    state.step += 1
    adaptive = state.adaptive
    return bool(adaptive) and state.step >= state.warmup_steps and state.step % adaptive.interval == 0


def _layers_with_feedback(state: CGXState, compressed: list) -> list:
    """The compressed layers that keep a residual; a layer whose setting is no longer
    fed back (an adaptive plan moved it) forgets its stale one."""
    fed = []
    for entry in compressed:
        name, _, _, setting = entry
        if state.feeds_back(setting):
            fed.append(entry)
        else:
            state.residuals.pop(name, None)
    return fed


def _inspect_and_feed_back_locally(state: CGXState, buffer: torch.Tensor, compressed: list, group_settings,
                                   decides: bool) -> None:
    """Samples the layers' quantization error; feeds adaptive selection on the rank that
    decides (`decides`); for one-level feedback, adds each compressed layer's residual to
    its gradient and keeps the new one."""
    sample = state.stats_every > 0 and state.step % state.stats_every == 0
    adaptive = state.adaptive if decides else None
    local_feedback = not state.two_level and any(state.feeds_back(s) for *_, s in compressed)
    if not (local_feedback or sample or adaptive):
        return
    # The group's rounding settings, so that Q(g) here is what goes on the wire.
    skip = group_settings.skip_incomplete_buckets
    stochastic = group_settings.stochastic_rounding
    for name, offset, numel, setting in compressed:
        view = buffer.narrow(0, offset, numel)
        grad = view.float()
        if grad.data_ptr() == view.data_ptr():
            grad = grad.clone()  # keep the unquantized values apart from the buffer
        if adaptive:
            adaptive.accumulate(name, grad)
        local = not state.two_level and state.feeds_back(setting)
        if not (local or sample):
            continue
        residual = state.residuals.get(name) if state.feeds_back(setting) else None
        if residual is not None and residual.numel() == numel:
            grad += residual  # what will be quantized (two-level: the collective adds it)
            if local:
                view.copy_(grad)
        # One-level: the buffer as it goes on the wire (float16 rounds what it holds).
        decoded = _C.decompress(
            _C.compress(view if local else grad, setting.bits, setting.bucket_size,
                        stochastic=stochastic, seed=state.step, skip_incomplete_buckets=skip,
                        scheme=setting.scheme),
            numel, setting.bits, setting.bucket_size, skip_incomplete_buckets=skip, scheme=setting.scheme,
        )
        if local:
            # A bucket that overflowed decodes to NaN: carry nothing of it forward.
            state.residuals[name] = torch.nan_to_num(grad - decoded, nan=0.0, posinf=0.0, neginf=0.0)
        if sample:
            norm = float(grad.norm())
            state.layer_errors[name] = float((decoded - grad).norm()) / norm if norm > 0 else 0.0


def _replan(state: CGXState, group: dist.ProcessGroup) -> None:
    """Rank 0 chooses the layers' settings from its accumulated gradients; every rank
    applies the same plan from the next step (one broadcast)."""
    # One int tensor, not a pickled object (nothing from a peer is unpickled): a first row
    # saying whether rank 0 could choose (a failure is raised on every rank after the
    # broadcast, never on rank 0 alone while the others wait in it), then (bits,
    # bucket_size, index of the scheme) per layer in name order (every rank knows the names).
    names = sorted(state.layer_settings)
    chosen, problem = dict(state.layer_settings), None
    if group.rank() == 0:
        try:
            chosen.update(state.adaptive.choose())
        except Exception as e:  # noqa: BLE001  (raised below, on every rank)
            problem = e
    table = torch.tensor([(int(problem is None), 0, 0)] + [
        (chosen[n].bits, chosen[n].bucket_size, SCHEMES.index(chosen[n].scheme)) for n in names],
        dtype=torch.int64)
    state.adaptive.accumulated = {}
    dist.broadcast(table, group_src=0, group=group)
    if not table[0, 0]:
        raise RuntimeError(
            f"cgx_hook: rank 0 could not choose the adaptive plan at step {state.step}"
            + (f": {problem}" if problem else " (the cause is in rank 0's error)")
        ) from problem
    state.set_layer_settings({n: LayerSetting(b, k, SCHEMES[s]) for n, (b, k, s) in zip(names, table[1:].tolist())})
