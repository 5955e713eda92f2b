"""Sparse outer gradients (cgx.DiLoCo's ``top_k=``): of every chunk of a compressed
layer's outer gradient (plus its error feedback), a replica sends the `k` values largest
in magnitude, quantized by cgx's codec at the layer's setting, with their places in the
chunk in Elias-Fano's code (under 3 + log2(chunk / k) bits each, 7 at 32 of 1,024; a fixed
size per chunk); exact (raw) layers go whole, in float32.
What it does not send stays in its residual. The replicas choose different places, so
their payloads are all-gathered and every replica decodes and sums them in rank order:
the same float operations on every replica, so the same global weights, bit for bit.

With ``shared=True`` every replica sends the same places instead, k of each chunk drawn
at random from the sync's step: no places travel, and the values go in cgx's compressed
allreduce (whose bytes a replica sends do not grow with the replicas), its error
feedback kept in the residual of each place sent."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cgx import _C
from cgx.config import check_int
from cgx.layers import RAW_BITS, Segment


@dataclass(frozen=True)
class TopK:
    """Which values of an outer gradient a replica sends: of each chunk of `chunk`
    consecutive values of a compressed layer (a layer's last chunk may be shorter), the
    `k` largest in magnitude (of equal ones the first; NaN above every number) of the
    outer gradient plus `decay` times the residual (what earlier syncs did not send;
    SparseLoCo's beta, with which the residual takes the outer momentum's part: then give
    DiLoCo outer_momentum=0). With `shared`, every
    replica sends the same k places of each chunk, drawn at random from the sync's step,
    in an allreduce, in place of each replica's own top k in an all-gather."""

    k: int = 32  # the defaults: measured on three tasks x three seeds (docs/diloco.md)
    chunk: int = 1024
    decay: float = 0.95
    shared: bool = False

    def __post_init__(self) -> None:
        what = "cgx.diloco.TopK"
        check_int(self.k, "k", what, low=1)
        check_int(self.chunk, "chunk", what, low=1)
        if self.k > self.chunk:
            raise ValueError(f"{what}: k={self.k} is more than chunk={self.chunk} (k values of each chunk are sent)")
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 < self.decay <= 1:
            raise ValueError(f"{what}: decay must be in (0, 1], got {self.decay!r}")
        object.__setattr__(self, "decay", float(self.decay))  # as every replica compares it
        if not isinstance(self.shared, bool):
            raise TypeError(f"{what}: shared must be a bool, got {type(self.shared).__name__}")


@dataclass(frozen=True)
class _Piece:
    """A segment of the fragment's flat outer gradient, as its payload carries it."""

    offset: int  # in the flat outer gradient
    numel: int
    bits: int  # RAW_BITS: whole, in float32
    bucket_size: int
    scheme: str
    rows: int = 1  # chunks
    width: int = 0  # values a chunk holds (the last one padded with zeros to it)
    kept: int = 0  # values sent of each chunk
    low_bits: int = 0  # a place's low bits, stored as they are; its high part in unary
    code_bytes: int = 0  # the places' code
    value_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return 4 * self.numel if self.bits == RAW_BITS else self.code_bytes + self.value_bytes


class SparsePlan:
    """How a fragment's outer gradient travels sparsely: its layout's segments, each as
    a piece of one payload of `nbytes` bytes (the same size on every replica)."""

    def __init__(self, layout: list[Segment], top_k: TopK) -> None:
        self.layout = list(layout)
        self.pieces: list[_Piece] = []
        for offset, numel, bits, bucket_size, *scheme in layout:
            scheme_name = (scheme or ["maxmin"])[0]
            if bits == RAW_BITS:
                self.pieces.append(_Piece(offset, numel, bits, bucket_size, scheme_name))
                continue
            rows, width, kept, low_bits, code_bytes = _C.chunk_places(numel, top_k.chunk, top_k.k)
            self.pieces.append(_Piece(
                offset, numel, bits, bucket_size, scheme_name, rows, width, kept, low_bits, code_bytes,
                _C.compressed_size(rows * kept, bits, bucket_size, scheme=scheme_name)))
        self.nbytes = sum(p.nbytes for p in self.pieces)

    def encode(self, values: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """This replica's payload for the flat float32 `values` (outer gradient plus
        residual). With `residual`, writes there what it keeps: `values` minus what it
        sends as the others decode it (zero for the raw pieces, sent whole)."""
        payload = torch.empty(self.nbytes, dtype=torch.uint8, device=values.device)
        if residual is not None:
            residual.copy_(values)
        at = 0
        for p in self.pieces:
            part = values.narrow(0, p.offset, p.numel)
            piece = payload.narrow(0, at, p.nbytes)
            at += p.nbytes
            if p.bits == RAW_BITS:
                piece.copy_(part.contiguous().view(torch.uint8))
                if residual is not None:
                    residual.narrow(0, p.offset, p.numel).zero_()
                continue
            # The selection and its code on the CPU (a GPU's values copied: the code is small).
            code, kept, places = _C.select_places(part.cpu().contiguous(), p.rows, p.width, p.kept, p.low_bits)
            piece.narrow(0, 0, p.code_bytes).copy_(code)
            values_part = piece.narrow(0, p.code_bytes, p.value_bytes)
            values_part.copy_(_C.compress(kept.to(values.device), p.bits, p.bucket_size, scheme=p.scheme))
            if residual is not None:  # minus what is sent: plus its negation, the same float operation
                decoded = _C.decompress(values_part, p.rows * p.kept, p.bits, p.bucket_size, scheme=p.scheme)
                _at_places(residual.narrow(0, p.offset, p.numel), p, places.to(values.device), decoded.neg_(), add=True)
        return payload

    def add(self, payload: torch.Tensor, into: torch.Tensor) -> None:
        """Adds what a replica's `payload` carries into the flat float32 `into`."""
        at = 0
        for p in self.pieces:
            piece = payload.narrow(0, at, p.nbytes)
            target = into.narrow(0, p.offset, p.numel)
            at += p.nbytes
            if p.bits == RAW_BITS:
                target.add_(piece.clone().view(torch.float32))  # (a copy: the piece may not be aligned)
                continue
            places = _C.read_places(piece.narrow(0, 0, p.code_bytes).cpu(), p.rows, p.width, p.kept, p.low_bits)
            if places is None:
                raise ValueError(f"cgx.DiLoCo: a sparse payload holds places that are not {p.kept} ascending ones in "
                                 f"each chunk of {p.width} values: the replicas' plans differ")
            decoded = _C.decompress(piece.narrow(0, p.code_bytes, p.value_bytes), p.rows * p.kept, p.bits,
                                    p.bucket_size, scheme=p.scheme)
            _at_places(target, p, places.to(into.device), decoded, add=True)

    def shared_places(self, seed: int, device: torch.device) -> list[torch.Tensor | None]:
        """Per piece, the (chunks, kept) ascending places every replica sends with
        `shared` (None for a raw piece): k of each chunk at random, the same for one
        `seed` on every replica."""
        generator = torch.Generator().manual_seed(seed)
        return [None if p.bits == RAW_BITS else
                _C.select_places(torch.rand(p.rows * p.width, generator=generator), p.rows, p.width, p.kept, p.low_bits)[2]
                .to(device) for p in self.pieces]

    def selected_layout(self) -> list[Segment]:
        """The layout of `select`'s values: raw pieces whole, the others' kept values at
        their layer's setting."""
        layout, at = [], 0
        for p in self.pieces:
            numel = p.numel if p.bits == RAW_BITS else p.rows * p.kept
            layout.append((at, numel, p.bits, p.bucket_size, p.scheme))
            at += numel
        return layout

    def select(self, values: torch.Tensor, places: list[torch.Tensor | None]) -> torch.Tensor:
        """The flat `values` at `places` (`shared_places`), as `selected_layout` lays them out."""
        return torch.cat([values.narrow(0, p.offset, p.numel) if chosen is None
                          else _at(values.narrow(0, p.offset, p.numel), p, chosen)
                          for p, chosen in zip(self.pieces, places)])

    def put(self, selected: torch.Tensor, places: list[torch.Tensor | None], into: torch.Tensor) -> None:
        """Writes `selected` (as `select` laid it out) at its places in the flat `into`;
        its other values stay."""
        at = 0
        for p, chosen in zip(self.pieces, places):
            target = into.narrow(0, p.offset, p.numel)
            numel = p.numel if chosen is None else p.rows * p.kept
            if chosen is None:
                target.copy_(selected.narrow(0, at, numel))
            else:
                _at_places(target, p, chosen, selected.narrow(0, at, numel))
            at += numel


def _flat_places(p: _Piece, places: torch.Tensor) -> torch.Tensor:
    """The (rows, kept) places in their chunks as places in the piece (rows * kept; the
    last chunk's may fall in its padding, past the piece's end)."""
    starts = torch.arange(0, p.rows * p.width, p.width, device=places.device)
    return (places + starts.unsqueeze(1)).view(-1)


def _at(part: torch.Tensor, p: _Piece, places: torch.Tensor) -> torch.Tensor:
    """The piece's values at the (rows, kept) `places` (rows * kept; zero in the padding)."""
    flat = _flat_places(p, places)
    if p.rows * p.width == p.numel:
        return part.take(flat)
    padding = flat >= p.numel
    return part.take(flat.masked_fill(padding, 0)).masked_fill_(padding, 0)


def _at_places(target: torch.Tensor, p: _Piece, places: torch.Tensor, values: torch.Tensor, add: bool = False) -> None:
    """Writes (with `add`, adds) the rows * kept `values` at the (rows, kept) `places` of
    the piece's flat `target`; what falls in the last chunk's padding is dropped."""
    flat, values = _flat_places(p, places), values.reshape(-1)
    if p.rows * p.width != p.numel:
        inside = flat < p.numel
        flat, values = flat[inside], values[inside]
    if add:
        target.index_add_(0, flat, values)
    else:
        target.index_copy_(0, flat, values)
