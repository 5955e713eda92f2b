"""Per-layer compression policy, and the plan it resolves to for each DDP bucket.

A policy says how each parameter's gradient travels: quantized with some bits, bucket
size and scheme (``"maxmin"`` or ``"hadamard"``, docs/wire-format.md), or raw (exactly). Rules pick parameters by name pattern, module type and
size; the first rule that matches a parameter wins, the policy's defaults apply to the
rest. As in CGX, 1-D parameters (biases, norm weights) and small layers stay raw unless
a rule says otherwise.

Example::

    policy = cgx.CompressionPolicy(
        bits=4,
        rules=[
            cgx.LayerRule(module_type=torch.nn.Embedding, bits=8),
            cgx.LayerRule(pattern="*.bias", bits=32),
            cgx.LayerRule(pattern="head.*", bits=8, bucket_size=128),
        ],
    )

The plan of a bucket is a list of ``(offset, numel, bits, bucket_size, scheme)`` segments that
covers the bucket's flat buffer in order; it travels with each allreduce call
(``ProcessGroupCGX.allreduce_layout``), so no hidden state assumes the order of calls.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable

import torch

from cgx import _C
from cgx._C import MAX_BITS, MAX_BUCKET_SIZE, RAW_BITS, SCHEMES
from cgx.config import check_int, int_range, is_int

__all__ = ["LayerRule", "LayerSetting", "CompressionPolicy", "Segment", "all_raw", "layout_bytes"]

Segment = tuple[int, int, int, int, str]  # (offset, numel, bits, bucket_size, scheme)


def check_bits(bits: int, what: str, allow_raw: bool = True) -> None:
    if not (is_int(bits) and (1 <= bits <= MAX_BITS or (allow_raw and bits == RAW_BITS))):
        allowed = f"1..{MAX_BITS}" + (f", or {RAW_BITS} for uncompressed" if allow_raw else "")
        raise ValueError(f"{what}: bits must be in {allowed}, got {bits!r}")


def check_bucket_size(bucket_size: int, what: str) -> None:
    if not (is_int(bucket_size) and 1 <= bucket_size <= MAX_BUCKET_SIZE):
        raise ValueError(f"{what}: bucket_size must be in {int_range(1, MAX_BUCKET_SIZE)}, "
                         f"got {bucket_size!r}")


def check_scheme(scheme: str, what: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"{what}: scheme must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}")


def scheme_problem(bits: int, bucket_size: int, scheme: str) -> str | None:
    """Why the codec refuses these bits and bucket size in `scheme` (its own words), or None."""
    if bits == RAW_BITS:
        return None
    return _C.scheme_problem(bits, bucket_size, scheme) or None


def check_setting(bits: int, bucket_size: int, scheme: str, what: str) -> None:
    check_scheme(scheme, what)
    problem = scheme_problem(bits, bucket_size, scheme)
    if problem:
        raise ValueError(f"{what}: {problem}")


def fitted(bits: int, bucket_size: int, scheme: str) -> "LayerSetting":
    """The setting in `scheme` where the codec takes it, else in maxmin (hadamard stops at
    4 bits and needs a power-of-two bucket)."""
    if bits == RAW_BITS:
        return LayerSetting(RAW_BITS, bucket_size)
    return LayerSetting(bits, bucket_size, "maxmin" if scheme_problem(bits, bucket_size, scheme) else scheme)


@dataclass(frozen=True)
class LayerSetting:
    """How one parameter's gradient travels."""

    bits: int
    bucket_size: int
    scheme: str = "maxmin"

    @property
    def compressed(self) -> bool:
        return self.bits != RAW_BITS


@dataclass(frozen=True)
class LayerRule:
    """Settings for the parameters the rule matches.

    A parameter matches when every criterion the rule states holds: ``pattern``
    (fnmatch on the qualified parameter name, e.g. ``"encoder.*.weight"``),
    ``module_type`` (the module owning the parameter is an instance of it), ``max_numel``
    (the parameter has at most that many elements). ``bits=32`` leaves it uncompressed;
    ``bucket_size=None`` and ``scheme=None`` keep the policy's.
    """

    pattern: str | None = None
    module_type: type | tuple[type, ...] | None = None
    max_numel: int | None = None
    bits: int = RAW_BITS
    bucket_size: int | None = None
    scheme: str | None = None

    def __post_init__(self) -> None:
        what = f"cgx.LayerRule({self.pattern or self.module_type or self.max_numel})"
        if self.pattern is None and self.module_type is None and self.max_numel is None:
            raise ValueError("cgx.LayerRule: give at least one of pattern, module_type, max_numel")
        check_bits(self.bits, what)
        if self.bucket_size is not None:
            check_bucket_size(self.bucket_size, what)
        if self.scheme is not None:  # with the policy's bucket size it is checked at resolve()
            check_scheme(self.scheme, what)
            if self.bucket_size is not None:
                check_setting(self.bits, self.bucket_size, self.scheme, what)
        if self.max_numel is not None and (not isinstance(self.max_numel, int) or self.max_numel < 0):
            raise ValueError(f"{what}: max_numel must be an integer >= 0, got {self.max_numel!r}")

    def matches(self, name: str, module: torch.nn.Module, numel: int) -> bool:
        return (
            (self.pattern is None or fnmatch.fnmatchcase(name, self.pattern))
            and (self.module_type is None or isinstance(module, self.module_type))
            and (self.max_numel is None or numel <= self.max_numel)
        )


class CompressionPolicy:
    """Per-layer compression settings for a model.

    Args:
        bits: default bits for compressed layers (1..8, or 32 for none).
        bucket_size: default quantization bucket size.
        scheme: default quantizer scheme, ``"hadamard"`` (the default since cgx 0.2:
            it held 2, 3 and 4 bits on every task measured, docs/benchmarks.md) or
            ``"maxmin"``. A layer whose bits or bucket size the hadamard scheme cannot
            take (more than 4 bits, a bucket size that is not a power of two in
            8..65536) uses maxmin instead; a rule that names hadamard for such a layer
            is an error.
        rules: :class:`LayerRule` s, the first match wins.
        minimal_size: layers with at most this many elements stay raw (CGX's default).
        compress_1d: compress 1-D parameters (biases, norm weights) too; off as in CGX.
    """

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 512,
        rules: Iterable[LayerRule] = (),
        *,
        scheme: str = "hadamard",
        minimal_size: int = 16,
        compress_1d: bool = False,
    ) -> None:
        check_bits(bits, "cgx.CompressionPolicy")
        check_bucket_size(bucket_size, "cgx.CompressionPolicy")
        check_scheme(scheme, "cgx.CompressionPolicy")
        check_int(minimal_size, "minimal_size", "cgx.CompressionPolicy")
        self.bits = bits
        self.bucket_size = bucket_size
        self.scheme = scheme
        self.rules = tuple(rules)
        for rule in self.rules:
            if not isinstance(rule, LayerRule):
                raise TypeError(f"cgx.CompressionPolicy: rules must be LayerRule, got {rule!r}")
        self.minimal_size = minimal_size
        self.compress_1d = compress_1d

    @classmethod
    def from_settings(cls, settings, *, bits: int | None = None, bucket_size: int | None = None,
                      minimal_size: int | None = None) -> "CompressionPolicy":
        """The policy a group's settings (``cgx.get_backend(group).settings``: the CGX_*
        variables or its ``pg_options``) give, with the arguments given here instead of
        theirs."""
        return cls(bits=settings.bits if bits is None else bits,
                   bucket_size=settings.bucket_size if bucket_size is None else bucket_size,
                   scheme=settings.scheme.name,
                   minimal_size=settings.minimal_size if minimal_size is None else minimal_size)

    def setting_for(self, name: str, module: torch.nn.Module, param: torch.Tensor,
                    bits: int | None = None) -> LayerSetting:
        """The parameter's setting. With `bits` (cgx.qsdp's weight or gradient bits), a
        layer the policy compresses takes those bits instead of its own, in the scheme the
        policy or its rule asks for where that scheme takes them; a raw layer stays raw."""
        def width(own: int) -> int:
            return own if bits is None or own == RAW_BITS else bits

        for rule in self.rules:
            if rule.matches(name, module, param.numel()):
                bucket_size = rule.bucket_size or self.bucket_size
                if rule.scheme is not None:
                    check_setting(rule.bits, bucket_size, rule.scheme, f"cgx.LayerRule for {name!r}")
                return fitted(width(rule.bits), bucket_size, rule.scheme or self.scheme)
        if param.numel() <= self.minimal_size or (param.dim() <= 1 and not self.compress_1d):
            return LayerSetting(RAW_BITS, self.bucket_size)
        return fitted(width(self.bits), self.bucket_size, self.scheme)

    def resolve(self, model: torch.nn.Module) -> dict[str, LayerSetting]:
        """The setting of every trainable parameter of `model`, by qualified name.

        Raises ValueError for a rule that selects no parameter (a typo would otherwise
        silently compress a layer the user meant to protect): naming the criterion that
        matches nothing, or saying that the criteria never match together."""
        owners = {}
        for module_name, module in model.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                owners[f"{module_name}.{param_name}" if module_name else param_name] = module
        settings = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                settings[name] = self.setting_for(name, owners[name], param)
        for rule in self.rules:
            if rule.pattern is not None and not any(
                fnmatch.fnmatchcase(n, rule.pattern) for n in settings
            ):
                raise ValueError(
                    f"cgx.LayerRule pattern {rule.pattern!r} matches no trainable parameter "
                    f"(parameters look like {next(iter(settings), '<none>')!r})"
                )
            if rule.module_type is not None and not any(
                isinstance(owners[n], rule.module_type) for n in settings
            ):
                raise ValueError(
                    f"cgx.LayerRule module_type {rule.module_type!r} matches no module that "
                    f"owns a trainable parameter"
                )
            if not any(rule.matches(n, owners[n], p.numel())
                       for n, p in model.named_parameters() if n in settings):
                raise ValueError(
                    f"{rule} matches no trainable parameter: its criteria never hold together"
                    if rule.pattern is not None or rule.module_type is not None
                    else f"{rule} matches no trainable parameter (none has at most "
                         f"{rule.max_numel} elements)"
                )
        return settings


def bucket_plan(
    bucket: torch.distributed.GradBucket,
    settings_by_param: dict[int, tuple[str, LayerSetting]],
) -> tuple[list[Segment], list[tuple[str, int, int, LayerSetting]]]:
    """The plan of one DDP bucket: the segments covering its flat buffer in order, and the
    compressed parameters in it as (name, offset, numel, setting).

    `settings_by_param` maps id(parameter) -> (name, setting). Offsets come from where
    each gradient view lies in the buffer, so the plan follows DDP's layout, also after it
    rebuilds its buckets."""
    buffer = bucket.buffer()
    base, itemsize, total = buffer.data_ptr(), buffer.element_size(), buffer.numel()
    pieces = []
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        if id(param) not in settings_by_param:
            raise ValueError(
                f"cgx_hook: DDP bucket {bucket.index()} holds a parameter of shape "
                f"{tuple(param.shape)} that is not in the model the CGXState was built on: "
                f"build it with the module DDP wraps (cgx.CGXState(group, model)), or after "
                f"unpickling attach that module (state.attach(model))"
            )
        name, setting = settings_by_param[id(param)]
        pieces.append(((grad.data_ptr() - base) // itemsize, grad.numel(), name, setting))
    pieces.sort(key=lambda p: p[0])

    segments: list[Segment] = []
    compressed = []
    cursor = 0
    for offset, numel, name, setting in pieces:
        append_segment(segments, cursor, offset - cursor, RAW)  # padding DDP may leave between views
        if setting.compressed and numel > 0:
            compressed.append((name, offset, numel, setting))
        append_segment(segments, offset, numel, setting)
        cursor = max(cursor, offset + numel)
    append_segment(segments, cursor, total - cursor, RAW)
    return segments, compressed


def all_raw(layout: list[Segment]) -> bool:
    """Whether a plan sends every value exactly (nothing in it is quantized)."""
    return all(bits == RAW_BITS for _, _, bits, *_ in layout)


def layout_bytes(layout: list[Segment], skip_incomplete_buckets: bool, sent_exactly: bool = False) -> int:
    """The payload of a buffer sent with `layout`: raw segments as float32, the others in
    their compressed size; all of it as float32 where `sent_exactly` (CGX_COMPRESSION_AUTO
    sent the call the exact way, ``cgx._C.sent_exactly(work)``)."""
    if sent_exactly:
        return 4 * sum(numel for _, numel, *_ in layout)
    return sum(4 * numel if bits == RAW_BITS else _C.compressed_size(
        numel, bits, bucket_size, skip_incomplete_buckets=skip_incomplete_buckets, scheme=(scheme or ["maxmin"])[0])
        for _, numel, bits, bucket_size, *scheme in layout)  # a 4-tuple is maxmin, as in the backend


RAW = LayerSetting(RAW_BITS, 1)  # a segment sent exactly


def append_segment(plan: list[Segment], offset: int, numel: int, setting: LayerSetting) -> None:
    """Appends a segment to a plan that ends at `offset`; a raw run next to a raw run
    merges with it (fewer, longer segments on every call); nothing for numel <= 0."""
    if numel <= 0:
        return
    if setting.compressed:
        plan.append((offset, numel, setting.bits, setting.bucket_size, setting.scheme))
    elif plan and plan[-1][2] == RAW_BITS:
        o, n, *_ = plan.pop()
        plan.append((o, n + numel, RAW_BITS, 1, "maxmin"))
    else:
        plan.append((offset, numel, RAW_BITS, 1, "maxmin"))
