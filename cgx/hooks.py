"""The cgx DDP communication hook and its state.

Example::

    import cgx, torch.distributed as dist
    dist.init_process_group("cgx")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=4), warmup_steps=100)
    ddp.register_comm_hook(state, cgx.cgx_hook)

torch_cgx's form works unchanged (no model: layers are told apart by DDP's buckets)::

    state = cgx.CGXState(dist.group.WORLD, layer_min_size=1024,
                         compression_params={"bits": 4, "bucket_size": 1024})
    ddp.register_comm_hook(state, cgx.cgx_hook)

Each bucket is averaged with one ``allreduce_layout`` call on the "cgx" group: the
bucket's per-layer plan (which slice is which parameter, with its bits and bucket size)
travels with the call, so other allreduces on the same group in between (metrics, loss
averaging, a distributed loss) cannot disturb it.

Error feedback (on by default) keeps, per compressed parameter, what quantization dropped
and adds it to the next step's gradient. Two-level (the default) feeds back both stages:
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
from typing import Any

import torch
import torch.distributed as dist

from cgx import _C
from cgx.backend import get_backend
from cgx.adaptive import AdaptiveBits
from cgx.layers import (RAW_BITS, CompressionPolicy, LayerSetting, bucket_plan, check_bits,
                        check_bucket_size)

__all__ = ["CGXState", "cgx_hook"]


class CGXState:
    """State of :func:`cgx_hook`: the policy, error-feedback residuals, warm-up, stats.

    Args:
        process_group: a "cgx" group, or None for the default group.
        model: the module wrapped by DDP (its parameter names key the policy). None tells
            layers apart by DDP's buckets instead: parameter ``i`` of bucket ``b`` when the
            hook first sees it is layer ``"bucket{b}.{i}"``; rules by pattern or module
            type then need the model.
        policy: per-layer settings; None takes bits, bucket size and minimal size from
            the group's settings (the CGX_* variables or its ``pg_options``).
        layer_min_size, compression_params: torch_cgx's way to say the policy, instead
            of ``policy``: layers with 2+ dimensions and at least ``layer_min_size``
            elements (and more than the group's minimal size) are compressed with
            ``compression_params["bits"]`` and ``["bucket_size"]`` (each defaulting to
            the group's setting).
        error_feedback: keep and re-add each layer's quantization residual.
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
        "layers_from_buckets",
        "error_feedback",
        "two_level",
        "warmup_steps",
        "stats_every",
        "adaptive",
        # wiring to the model (not pickled: rebuilt by attach())
        "_params",
        "_settings_by_param",
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
        error_feedback: bool = True,
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
        if torch_cgx_form:
            policy = _torch_cgx_policy(process_group, layer_min_size, compression_params)
        self.process_group = process_group
        self.policy = policy if policy is not None else _policy_of(process_group)
        self.layers_from_buckets = model is None
        if self.layers_from_buckets:
            _check_needs_no_model(self.policy)
        self.error_feedback = bool(error_feedback)
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
        self._params: dict[str, torch.Tensor] = {}  # the layers by name
        self._settings_by_param: dict[int, tuple[str, LayerSetting]] = {}
        if model is not None:
            self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Resolves the policy on `model` (after unpickling: re-attach the model)."""
        self.layers_from_buckets = False
        resolved = self.policy.resolve(model)
        # Settings chosen later (adaptive selection, a loaded checkpoint) stay.
        self.layer_settings = {**resolved, **{n: s for n, s in self.layer_settings.items() if n in resolved}}
        self._params = {n: p for n, p in model.named_parameters() if n in resolved}
        self._rewire()

    def set_layer_settings(self, settings: dict[str, LayerSetting]) -> None:
        """Replaces the settings of the named layers (e.g. from adaptive selection).
        Without a model, layers the hook has not seen yet keep theirs until it does."""
        unknown = set(settings) - set(self.layer_settings)
        if unknown and not self.layers_from_buckets:
            raise ValueError(f"cgx.CGXState: unknown layers {sorted(unknown)}")
        self.layer_settings.update(settings)
        self._rewire()

    def _learn_layers(self, bucket: dist.GradBucket) -> None:
        """Without a model: names and settings for the bucket's parameters not seen yet
        (a setting already known by that name, from a checkpoint, wins)."""
        for i, param in enumerate(bucket.parameters()):
            if id(param) in self._settings_by_param:
                continue
            name = f"bucket{bucket.index()}.{i}"
            if name in self._params:  # first seen after DDP rebuilt its buckets
                name = f"{name}.step{self.step}"
            residual = self.residuals.get(name)
            if residual is not None and residual.numel() != param.numel():
                raise ValueError(
                    f"cgx_hook: the loaded residual of layer {name!r} has {residual.numel()} "
                    f"values, its parameter {param.numel()}: the checkpoint is another model's"
                )
            setting = self.layer_settings.get(name) or self.policy.setting_for(name, None, param)
            self.layer_settings[name] = setting
            self._params[name] = param
            self._settings_by_param[id(param)] = (name, setting)

    def _rewire(self) -> None:
        self._settings_by_param = {
            id(p): (n, self.layer_settings[n]) for n, p in self._params.items()
        }

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
        return {
            "rank": self._rank(),
            "step": self.step,
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "layer_settings": {n: (s.bits, s.bucket_size) for n, s in self.layer_settings.items()},
            "adaptive_accumulated": (
                {n: g.clone() for n, g in self.adaptive.accumulated.items()} if self.adaptive else {}
            ),
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads this rank's state_dict(); ValueError naming the key for anything else."""
        _check_state_dict(state, {n: p.numel() for n, p in self._params.items()})
        rank = self._rank()
        if state["rank"] is not None and rank is not None and state["rank"] != rank:
            raise ValueError(
                f"cgx.CGXState.load_state_dict: this is rank {state['rank']}'s state, loaded on "
                f"rank {rank}; error-feedback residuals are per rank, so every rank must save "
                f"and load its own state_dict()"
            )
        if self.adaptive:
            self.adaptive.accumulated = {n: g.clone() for n, g in state["adaptive_accumulated"].items()}
        self.step = int(state["step"])
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_uncompressed = int(state["bytes_uncompressed"])
        self.set_layer_settings({n: LayerSetting(*s) for n, s in state["layer_settings"].items()})

    def group(self) -> dist.ProcessGroup:
        """The process group the hook reduces on (the default group when None)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _rank(self) -> int | None:
        return dist.get_rank(self.group()) if dist.is_initialized() else None

    def __getstate__(self) -> dict[str, Any]:
        # The process group and the parameter wiring do not survive pickling.
        return {
            slot: getattr(self, slot)
            for slot in self.__slots__
            if slot not in ("process_group", "_params", "_settings_by_param")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self._params = {}
        self._settings_by_param = {}
        self.two_level = True  # a state pickled before two-level feedback existed
        for slot, value in state.items():
            setattr(self, slot, value)

    # ---- per bucket

    def _prepare(self, buffer: torch.Tensor, compressed: list, group_settings, decides: bool) -> None:
        """Samples the layers' quantization error; feeds adaptive selection on the rank
        that decides (`decides`); for one-level feedback, adds each compressed layer's
        residual to its gradient and keeps the new one."""
        sample = self.stats_every > 0 and self.step % self.stats_every == 0
        adaptive = self.adaptive if decides else None
        local_feedback = self.error_feedback and not self.two_level
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
            if not (local_feedback or sample):
                continue
            residual = self.residuals.get(name) if self.error_feedback else None
            if residual is not None and residual.numel() == numel:
                grad += residual  # what will be quantized (two-level: the collective adds it)
                if local_feedback:
                    view.copy_(grad)
            # One-level: the buffer as it goes on the wire (float16 rounds what it holds).
            decoded = _C.decompress(
                _C.compress(view if local_feedback else grad, setting.bits, setting.bucket_size,
                            stochastic=stochastic,
                            seed=self.step, skip_incomplete_buckets=skip),
                numel, setting.bits, setting.bucket_size, skip_incomplete_buckets=skip,
            )
            if local_feedback:
                # A bucket that overflowed decodes to NaN: carry nothing of it forward.
                self.residuals[name] = torch.nan_to_num(grad - decoded, nan=0.0, posinf=0.0, neginf=0.0)
            if sample:
                norm = float(grad.norm())
                self.layer_errors[name] = float((decoded - grad).norm()) / norm if norm > 0 else 0.0

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

    def _count(self, buffer: torch.Tensor, layout: list, skip_incomplete: bool) -> None:
        self.bytes_uncompressed += buffer.numel() * buffer.element_size()
        if all(bits == RAW_BITS for _, _, bits, _ in layout):
            self.bytes_sent += buffer.numel() * buffer.element_size()  # Gloo, in its dtype
            return
        for _, numel, bits, bucket_size in layout:
            self.bytes_sent += 4 * numel if bits == RAW_BITS else _C.compressed_size(
                numel, bits, bucket_size, skip_incomplete_buckets=skip_incomplete)


_STATE_KEYS = ("rank", "step", "residuals", "layer_settings", "adaptive_accumulated",
               "bytes_sent", "bytes_uncompressed")


def _check_state_dict(state: Any, numels: dict[str, int]) -> None:
    """What CGXState.load_state_dict accepts: a dict of state_dict()'s form, with valid
    settings and residuals that fit the layers (`numels`, where known)."""
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
        if not (isinstance(setting, (tuple, list)) and len(setting) == 2):
            raise ValueError(f"{what}: layer_settings[{name!r}] must be (bits, bucket_size), got {setting!r}")
        check_bits(setting[0], f"{what}: layer_settings[{name!r}]")
        check_bucket_size(setting[1], f"{what}: layer_settings[{name!r}]")
    for key in ("residuals", "adaptive_accumulated"):
        for name, tensor in state[key].items():
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                raise ValueError(f"{what}: {key}[{name!r}] must be a float tensor, got {tensor!r}")
            if name in numels and tensor.numel() != numels[name]:
                raise ValueError(
                    f"{what}: {key}[{name!r}] has {tensor.numel()} values, the layer "
                    f"{numels[name]}: the state is another model's"
                )


def _policy_of(group: dist.ProcessGroup | None) -> CompressionPolicy:
    """The group's settings as a policy: the environment (or pg_options) is the default
    that a policy given in Python overrides."""
    settings = get_backend(group).settings
    return CompressionPolicy(bits=settings.bits, bucket_size=settings.bucket_size,
                             minimal_size=settings.minimal_size)


_TORCH_CGX_PARAMS = ("bits", "bucket_size")


def _torch_cgx_policy(group: dist.ProcessGroup | None, layer_min_size: int | None,
                      compression_params: dict[str, int] | None) -> CompressionPolicy:
    """torch_cgx's CGXState arguments as a policy, with torch_cgx's meaning: compress
    layers of 2+ dimensions with at least `layer_min_size` elements (default 1024), and
    more than the group's minimal size; bits and bucket size default to the group's."""
    params = dict(compression_params or {})
    unknown = set(params) - set(_TORCH_CGX_PARAMS)
    if unknown:
        raise ValueError(
            f"cgx.CGXState: unknown compression_params {sorted(unknown)} "
            f"(torch_cgx's are {list(_TORCH_CGX_PARAMS)})"
        )
    if layer_min_size is None:
        layer_min_size = 1024
    if not isinstance(layer_min_size, int) or layer_min_size < 0:
        raise ValueError(f"cgx.CGXState: layer_min_size must be an integer >= 0, got {layer_min_size!r}")
    group_policy = _policy_of(group)
    return CompressionPolicy(
        bits=params.get("bits", group_policy.bits),
        bucket_size=params.get("bucket_size", group_policy.bucket_size),
        # torch_cgx compresses numel >= layer_min_size; the policy keeps numel <= minimal_size raw.
        minimal_size=max(layer_min_size - 1, group_policy.minimal_size),
    )


def _check_needs_no_model(policy: CompressionPolicy) -> None:
    for rule in policy.rules:
        if rule.pattern is not None or rule.module_type is not None:
            raise ValueError(
                f"cgx.CGXState: {rule} picks layers by name or module type, which needs the "
                f"model: CGXState(group, model, policy)"
            )


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages a DDP bucket with per-layer compression. Register with
    ``ddp.register_comm_hook(state, cgx.cgx_hook)``."""
    if not (state._settings_by_param or state.layers_from_buckets):
        raise RuntimeError("cgx_hook: the state has no model attached (after unpickling, call state.attach(model))")
    group = state.group()
    backend = get_backend(group)
    settings = backend.settings
    if state.error_feedback and not state.two_level and settings.stochastic_rounding:
        raise ValueError(
            "cgx_hook: one-level error feedback (two_level=False) estimates the residual "
            "with round-to-nearest, but the group rounds stochastically "
            "(CGX_COMPRESSION_STOCHASTIC_ROUNDING): create the CGXState with two_level=True "
            "or error_feedback=False"
        )
    buffer = bucket.buffer()
    buffer.div_(group.size())  # divide first, as torch's hooks do (no fp16 overflow)
    if buffer.is_sparse:  # nn.Embedding(sparse=True): reduced exactly, as without a hook
        state._count_sparse(buffer)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    else:
        if state.layers_from_buckets:
            state._learn_layers(bucket)
        residual, compressed = None, []
        if state.step < state.warmup_steps:
            layout = [(0, buffer.numel(), RAW_BITS, 1)]
        else:
            layout, compressed = bucket_plan(bucket, state._settings_by_param)
            state._prepare(buffer, compressed, settings, decides=group.rank() == 0)
            if state.error_feedback and state.two_level and compressed:
                residual = state._bucket_residual(buffer, compressed)
        state._count(buffer, layout, settings.skip_incomplete_buckets)
        future = backend.allreduce_layout(buffer, layout, residual=residual).get_future()
        if residual is not None:
            def keep(done, residual=residual, compressed=compressed):
                result = done.value()  # a failed call raises here and keeps the old residuals
                state._keep_residuals(residual, compressed)
                return result
            future = future.then(keep)
    if bucket.is_last():
        state.step += 1
        if state.adaptive and state.step >= state.warmup_steps and state.step % state.adaptive.interval == 0:
            _replan(state, group)
    return future.then(lambda f: f.value()[0])


def _replan(state: CGXState, group: dist.ProcessGroup) -> None:
    """Rank 0 chooses the layers' settings from its accumulated gradients; every rank
    applies the same plan from the next step."""
    # One int tensor, not a pickled object (nothing from a peer is unpickled): a first row
    # saying whether rank 0 could choose (a failure is raised on every rank after the
    # broadcast, never on rank 0 alone while the others wait in it), then (bits,
    # bucket_size) per layer in name order (every rank knows the names).
    names = sorted(state.layer_settings)
    chosen, problem = dict(state.layer_settings), None
    if group.rank() == 0:
        try:
            chosen.update(state.adaptive.choose())
        except Exception as e:  # noqa: BLE001  (raised below, on every rank)
            problem = e
    table = torch.tensor([(int(problem is None), 0)] + [(chosen[n].bits, chosen[n].bucket_size) for n in names],
                         dtype=torch.int64)
    state.adaptive.accumulated = {}
    dist.broadcast(table, group_src=0, group=group)
    if not table[0, 0]:
        raise RuntimeError(
            f"cgx_hook: rank 0 could not choose the adaptive plan at step {state.step}"
            + (f": {problem}" if problem else " (the cause is in rank 0's error)")
        ) from problem
    state.set_layer_settings({n: LayerSetting(b, k) for n, (b, k) in zip(names, table[1:].tolist())})
