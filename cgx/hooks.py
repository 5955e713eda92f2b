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
import gc
from typing import Any

import torch
import torch.distributed as dist

from cgx import _C
from cgx.backend import get_backend
from cgx.adaptive import AdaptiveBits
from cgx.layers import (RAW_BITS, SCHEMES, CompressionPolicy, LayerSetting, bucket_plan, check_bits,
                        check_bucket_size, check_setting, layout_bytes)

__all__ = ["CGXState", "cgx_hook"]

# Layers compressed at this many bits or fewer get error feedback unless the state says
# otherwise (error_feedback=True or False).
FEEDBACK_MAX_BITS = 2


class CGXState:
    """State of :func:`cgx_hook`: the policy, error-feedback residuals, warm-up, stats.

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
        # stats
        "bytes_sent",
        "bytes_uncompressed",
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
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"cgx.CGXState: warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if not isinstance(stats_every, int) or stats_every < 0:
            raise ValueError(f"cgx.CGXState: stats_every must be an integer >= 0, got {stats_every!r}")
        torch_cgx_form = layer_min_size is not None or compression_params is not None
        if policy is not None and torch_cgx_form:
            raise ValueError(
                "cgx.CGXState: give either policy or torch_cgx's layer_min_size / "
                "compression_params, not both"
            )
        self.process_group = process_group
        self.policy = policy
        self._torch_cgx = _torch_cgx_args(layer_min_size, compression_params) if torch_cgx_form else None
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"cgx.CGXState: error_feedback must be True, False or None, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.two_level = bool(two_level)
        self.warmup_steps = warmup_steps
        self.stats_every = stats_every
        self.adaptive = adaptive
        self.step = 0
        self.residuals: dict[str, torch.Tensor] = {}
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
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

    def _resolve_policy(self) -> None:
        """The policy from the group's settings (and torch_cgx's arguments, if given)."""
        settings = get_backend(self.group()).settings
        if self._torch_cgx is None:
            self.policy = CompressionPolicy(bits=settings.bits, bucket_size=settings.bucket_size,
                                            scheme=settings.scheme.name, minimal_size=settings.minimal_size)
            return
        layer_min_size, params = self._torch_cgx
        self.policy = CompressionPolicy(
            bits=params.get("bits", settings.bits),
            bucket_size=params.get("bucket_size", settings.bucket_size),
            scheme=settings.scheme.name,
            # torch_cgx compresses numel >= layer_min_size; the policy keeps numel <= minimal_size raw.
            minimal_size=max(layer_min_size - 1, settings.minimal_size),
        )

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

    def _count_step(self, bucket: dist.GradBucket, group: dist.ProcessGroup) -> None:
        """Ends the step before a bucket whose parameters were already reduced in it: DDP
        did not say which bucket was its last (static_graph's first iteration on some
        torch versions calls every bucket index 0, none last)."""
        ids = [id(p) for p in bucket.parameters()]
        if not self._reduced.isdisjoint(ids):
            self._end_step(group)
        self._reduced.update(ids)

    def _end_step(self, group: dist.ProcessGroup) -> None:
        self._reduced.clear()
        self.step += 1
        if self.adaptive and self.step >= self.warmup_steps and self.step % self.adaptive.interval == 0:
            _replan(self, group)

    def _count_sparse(self, buffer: torch.Tensor) -> None:
        # Gloo reduces a sparse gradient by gathering every rank's indices and values.
        sent = buffer._indices().nbytes + buffer._values().nbytes
        self.bytes_sent += sent
        self.bytes_uncompressed += sent

    # ---- stats and checkpoints

    def compression_stats(self) -> dict[str, Any]:
        """Bytes this rank put into allreduces (payload) against uncompressed, and the last
        sampled relative quantization error of each compressed layer."""
        return {
            "step": self.step,
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "compression_ratio": self.bytes_uncompressed / max(1, self.bytes_sent),
            "layer_errors": dict(self.layer_errors),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: residuals (and adaptive statistics) differ between ranks, so
        every rank saves and loads its own."""
        placed = dist.is_initialized()
        return {
            "rank": dist.get_rank(self.group()) if placed else None,
            "world_size": self.group().size() if placed else None,
            "step": self.step,
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "layer_settings": {n: (s.bits, s.bucket_size, s.scheme) for n, s in self.layer_settings.items()},
            "adaptive_accumulated": (
                {n: g.clone() for n, g in self.adaptive.accumulated.items()} if self.adaptive else {}
            ),
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict(); ValueError naming the key for anything else. Before
        the model is known (a state made without one, not yet called), what depends on it is
        checked on the hook's first call."""
        _check_state_dict(state)
        if self._settings_by_param:
            _check_fits(state["layer_settings"], state["residuals"], self._params, "cgx.CGXState.load_state_dict")
        if state["residuals"] and dist.is_initialized():
            check_same_place(state, dist.get_rank(self.group()), self.group().size(),
                             "cgx.CGXState.load_state_dict")
        if self.adaptive:
            self.adaptive.accumulated = {n: g.clone() for n, g in state["adaptive_accumulated"].items()}
        self.step = int(state["step"])
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_uncompressed = int(state["bytes_uncompressed"])
        self.set_layer_settings({n: LayerSetting(*s) for n, s in state["layer_settings"].items()})

    def group(self) -> dist.ProcessGroup:
        """The process group the hook reduces on (the default group when None)."""
        if self.process_group is not None:
            return self.process_group
        if not dist.is_initialized():
            raise RuntimeError(
                "cgx.CGXState: the default process group does not exist yet: call "
                "torch.distributed.init_process_group before the first backward (the state "
                "itself may be made before)"
            )
        return dist.group.WORLD

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
        for slot, value in state.items():
            if slot in self.__slots__:  # older pickles hold slots since removed
                setattr(self, slot, value)

    # ---- per bucket

    def _prepare(self, buffer: torch.Tensor, compressed: list, group_settings, decides: bool) -> None:
        """Samples the layers' quantization error; feeds adaptive selection on the rank
        that decides (`decides`); for one-level feedback, adds each compressed layer's
        residual to its gradient and keeps the new one."""
        sample = self.stats_every > 0 and self.step % self.stats_every == 0
        adaptive = self.adaptive if decides else None
        local_feedback = not self.two_level and any(self.feeds_back(s) for *_, s in compressed)
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
            local = not self.two_level and self.feeds_back(setting)
            if not (local or sample):
                continue
            residual = self.residuals.get(name) if self.feeds_back(setting) else None
            if residual is not None and residual.numel() == numel:
                grad += residual  # what will be quantized (two-level: the collective adds it)
                if local:
                    view.copy_(grad)
            # One-level: the buffer as it goes on the wire (float16 rounds what it holds).
            decoded = _C.decompress(
                _C.compress(view if local else grad, setting.bits, setting.bucket_size,
                            stochastic=stochastic, seed=self.step, skip_incomplete_buckets=skip,
                            scheme=setting.scheme),
                numel, setting.bits, setting.bucket_size, skip_incomplete_buckets=skip, scheme=setting.scheme,
            )
            if local:
                # A bucket that overflowed decodes to NaN: carry nothing of it forward.
                self.residuals[name] = torch.nan_to_num(grad - decoded, nan=0.0, posinf=0.0, neginf=0.0)
            if sample:
                norm = float(grad.norm())
                self.layer_errors[name] = float((decoded - grad).norm()) / norm if norm > 0 else 0.0

    def feeds_back(self, setting: LayerSetting) -> bool:
        """Whether a layer compressed with `setting` keeps an error-feedback residual."""
        if self.error_feedback is None:
            return setting.bits <= FEEDBACK_MAX_BITS
        return self.error_feedback

    def _fed_back(self, compressed: list) -> list:
        """The compressed layers that keep a residual; a layer whose setting is no longer
        fed back (an adaptive plan moved it) forgets its stale one."""
        fed = []
        for entry in compressed:
            name, _, _, setting = entry
            if self.feeds_back(setting):
                fed.append(entry)
            else:
                self.residuals.pop(name, None)
        return fed

    def _bucket_residual(self, buffer: torch.Tensor, compressed: list) -> torch.Tensor:
        """The bucket's two-level residual: each compressed layer's, zero elsewhere."""
        residual = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for name, offset, numel, _ in compressed:
            kept = self.residuals.get(name)
            if kept is not None and kept.numel() == numel:
                residual.narrow(0, offset, numel).copy_(kept.reshape(-1))
        return residual

    def _keep_residuals(self, residual: torch.Tensor, compressed: list) -> None:
        """After the call: what each layer's quantizations dropped on this rank (copies:
        views would keep, and pickle, the whole bucket)."""
        for name, offset, numel, _ in compressed:
            self.residuals[name] = residual.narrow(0, offset, numel).clone()

    def _count(self, buffer: torch.Tensor, layout: list, skip_incomplete: bool, exactly: bool) -> None:
        """A completed bucket's payload; `exactly`: CGX_COMPRESSION_AUTO sent it raw."""
        self.bytes_uncompressed += buffer.numel() * buffer.element_size()
        if exactly or all(bits == RAW_BITS for _, _, bits, *_ in layout):
            self.bytes_sent += buffer.numel() * 4  # float32 values
            return
        self.bytes_sent += layout_bytes(layout, skip_incomplete)


_STATE_KEYS = ("rank", "world_size", "step", "residuals", "layer_settings", "adaptive_accumulated",
               "bytes_sent", "bytes_uncompressed")


_UNPICKLED = ("process_group", "_model", "_params", "_settings_by_param", "_reduced")


def _check_state_dict(state: Any) -> None:
    """What CGXState.load_state_dict accepts: a dict of state_dict()'s form, with valid
    settings and float residuals (whether they fit the model: _check_fits)."""
    what = "cgx.CGXState.load_state_dict"
    if not isinstance(state, dict):
        raise TypeError(f"{what}: expected the dict of CGXState.state_dict(), got {type(state).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"{what}: missing {missing} (expected the dict of CGXState.state_dict())")
    for key in ("step", "bytes_sent", "bytes_uncompressed"):
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{what}: {key!r} must be an integer >= 0, got {value!r}")
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


def check_same_place(state: dict[str, Any], rank: int, world_size: int, what: str) -> None:
    """Residuals are what this rank's quantizations dropped in a group of that size: they
    load on the same rank of a group of the same size only (`state` has the saving rank's
    "rank" and "world_size")."""
    if state["world_size"] is not None and state["world_size"] != world_size:
        raise ValueError(
            f"{what}: the state was saved in a group of {state['world_size']} ranks, loaded in "
            f"one of {world_size}; its error-feedback residuals belong to that group's ranks. "
            f"To resume at another size, load it with state['residuals'] = {{}} (feedback "
            f"restarts from zero; the rest carries over)"
        )
    if state["rank"] is not None and state["rank"] != rank:
        raise ValueError(
            f"{what}: this is rank {state['rank']}'s state, loaded on rank {rank}; "
            f"error-feedback residuals are per rank, so every rank must save and load its own "
            f"state_dict()"
        )


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
    if not isinstance(layer_min_size, int) or layer_min_size < 0:
        raise ValueError(f"cgx.CGXState: layer_min_size must be an integer >= 0, got {layer_min_size!r}")
    return layer_min_size, params


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages a DDP bucket with per-layer compression. Register with
    ``ddp.register_comm_hook(state, cgx.cgx_hook)``."""
    group = state.group()
    state._bind(bucket)
    backend = get_backend(group)
    settings = backend.settings
    if state.error_feedback is not False and not state.two_level and settings.stochastic_rounding:
        raise ValueError(
            "cgx_hook: one-level error feedback (two_level=False) estimates the residual "
            "with round-to-nearest, but the group rounds stochastically "
            "(CGX_COMPRESSION_STOCHASTIC_ROUNDING): create the CGXState with two_level=True "
            "or error_feedback=False"
        )
    state._count_step(bucket, group)
    buffer = bucket.buffer()
    buffer.div_(group.size())  # divide first, as torch's hooks do (no fp16 overflow)
    if buffer.is_sparse:  # nn.Embedding(sparse=True): reduced exactly, as without a hook
        state._count_sparse(buffer)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    else:
        residual, compressed, fed = None, [], []
        if state.step < state.warmup_steps:
            layout = [(0, buffer.numel(), RAW_BITS, 1, "maxmin")]
        else:
            layout, compressed = bucket_plan(bucket, state._settings_by_param)
            fed = state._fed_back(compressed)
            state._prepare(buffer, compressed, settings, decides=group.rank() == 0)
            if state.two_level and fed:
                residual = state._bucket_residual(buffer, fed)
        work = backend.allreduce_layout(buffer, layout, residual=residual)

        def settle(done, work=work, residual=residual, fed=fed):
            result = done.value()  # a failed call raises here and keeps the old residuals
            if residual is not None:
                state._keep_residuals(residual, fed)
            state._count(buffer, layout, settings.skip_incomplete_buckets, _C.sent_exactly(work))
            return result
        future = work.get_future().then(settle)
    if bucket.is_last():
        state._end_step(group)
    return future.then(lambda f: f.value()[0])


def _replan(state: CGXState, group: dist.ProcessGroup) -> None:
    """Rank 0 chooses the layers' settings from its accumulated gradients; every rank
    applies the same plan from the next step."""
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
