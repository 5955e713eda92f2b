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
    `k` largest in magnitude of the outer gradient plus `decay` times the residual (what
    earlier syncs did not send; SparseLoCo's beta, with which the residual takes the
    outer momentum's part: then give DiLoCo outer_momentum=0). With `shared`, every
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
    low_bytes: int = 0
    high_bytes: int = 0
    value_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return 4 * self.numel if self.bits == RAW_BITS else self.low_bytes + self.high_bytes + self.value_bytes

    @property
    def high_width(self) -> int:
        """Bits a chunk's unary high parts take: one set per place, one clear per high value passed."""
        return self.kept + ((self.width - 1) >> self.low_bits) + 1


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
            width = min(top_k.chunk, numel)
            rows = -(-numel // width)
            kept = min(top_k.k, width)
            low_bits = (width // kept).bit_length() - 1  # floor(log2(width / kept)): the fewest bits in all
            high_width = kept + ((width - 1) >> low_bits) + 1
            self.pieces.append(_Piece(
                offset, numel, bits, bucket_size, scheme_name, rows, width, kept, low_bits,
                -(-rows * kept * low_bits // 8), -(-rows * high_width // 8),
                _C.compressed_size(rows * kept, bits, bucket_size, scheme=scheme_name)))
        self.nbytes = sum(p.nbytes for p in self.pieces)

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's payload for the flat float32 `values` (outer gradient plus
        residual), and what it sends as the others decode it (flat, zero where it sends
        nothing): `values` minus that is what it keeps."""
        payload = torch.empty(self.nbytes, dtype=torch.uint8, device=values.device)
        sent = torch.empty_like(values)
        at = 0
        for p in self.pieces:
            part = values.narrow(0, p.offset, p.numel)
            if p.bits == RAW_BITS:
                payload.narrow(0, at, p.nbytes).copy_(part.contiguous().view(torch.uint8))
                sent.narrow(0, p.offset, p.numel).copy_(part)
                at += p.nbytes
                continue
            chunks = _padded(part, p)
            places = chunks.abs().topk(p.kept, dim=1, sorted=False).indices.sort(dim=1).values
            kept = chunks.gather(1, places).reshape(-1)
            piece = payload.narrow(0, at, p.nbytes)
            _encode_places(places, p, piece)
            piece.narrow(0, p.nbytes - p.value_bytes, p.value_bytes).copy_(
                _C.compress(kept, p.bits, p.bucket_size, scheme=p.scheme))
            at += p.nbytes
            sent.narrow(0, p.offset, p.numel).copy_(self._decoded(piece, p))
        return payload, sent

    def add(self, payload: torch.Tensor, into: torch.Tensor) -> None:
        """Adds what a replica's `payload` carries into the flat float32 `into`."""
        at = 0
        for p in self.pieces:
            piece = payload.narrow(0, at, p.nbytes)
            target = into.narrow(0, p.offset, p.numel)
            if p.bits == RAW_BITS:
                target.add_(piece.clone().view(torch.float32))  # (a copy: the piece may not be aligned)
            else:
                target.add_(self._decoded(piece, p))
            at += p.nbytes

    def shared_places(self, seed: int, device: torch.device) -> list[torch.Tensor | None]:
        """Per piece, the (chunks, kept) ascending places every replica sends with
        `shared` (None for a raw piece): k of each chunk at random, the same for one
        `seed` on every replica."""
        generator = torch.Generator().manual_seed(seed)
        return [None if p.bits == RAW_BITS else
                torch.rand(p.rows, p.width, generator=generator).topk(p.kept, dim=1, sorted=False)
                .indices.sort(dim=1).values.to(device) for p in self.pieces]

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
                          else _padded(values.narrow(0, p.offset, p.numel), p).gather(1, chosen).reshape(-1)
                          for p, chosen in zip(self.pieces, places)])

    def put(self, selected: torch.Tensor, places: list[torch.Tensor | None], into: torch.Tensor) -> None:
        """Writes `selected` (as `select` laid it out) at its places in the flat `into`;
        its other values stay."""
        at = 0
        for p, chosen in zip(self.pieces, places):
            target = into.narrow(0, p.offset, p.numel)
            if chosen is None:
                target.copy_(selected.narrow(0, at, p.numel))
                at += p.numel
                continue
            chunks = _padded(target, p)
            chunks.scatter_(1, chosen, selected.narrow(0, at, p.rows * p.kept).view(p.rows, p.kept))
            if chunks.data_ptr() != target.data_ptr():  # padded: a copy
                target.copy_(chunks.view(-1).narrow(0, 0, p.numel))
            at += p.rows * p.kept

    @staticmethod
    def _decoded(piece: torch.Tensor, p: _Piece) -> torch.Tensor:
        """A compressed piece's values in place (zero where none was sent), `p.numel` of them."""
        places = _decode_places(piece, p)
        values = _C.decompress(piece.narrow(0, p.nbytes - p.value_bytes, p.value_bytes), p.rows * p.kept, p.bits,
                               p.bucket_size, scheme=p.scheme)
        dense = torch.zeros(p.rows, p.width, dtype=torch.float32, device=piece.device)
        dense.scatter_(1, places, values.view(p.rows, p.kept))
        return dense.view(-1).narrow(0, 0, p.numel)


def _padded(part: torch.Tensor, p: _Piece) -> torch.Tensor:
    """The piece's values as (chunks, width), the last chunk padded with zeros."""
    if p.rows * p.width == p.numel:
        return part.view(p.rows, p.width)
    padded = torch.zeros(p.rows * p.width, dtype=part.dtype, device=part.device)
    padded.narrow(0, 0, p.numel).copy_(part)
    return padded.view(p.rows, p.width)


def _encode_places(places: torch.Tensor, p: _Piece, piece: torch.Tensor) -> None:
    """Writes the (chunks, kept) ascending `places` at the start of `piece`, in Elias-Fano's
    code: each place's `low_bits` low bits packed, then each chunk's high parts (place >>
    low_bits, ascending) as a bitmap of `high_width` bits with a bit set at high + i for its
    i-th place."""
    if p.low_bits:
        low = places & ((1 << p.low_bits) - 1)
        piece.narrow(0, 0, p.low_bytes).copy_(_pack(low.reshape(-1), p.low_bits))
    high = torch.zeros(p.rows, p.high_width, dtype=torch.uint8, device=places.device)
    high.scatter_(1, (places >> p.low_bits) + torch.arange(p.kept, device=places.device), 1)
    piece.narrow(0, p.low_bytes, p.high_bytes).copy_(_pack_stream(high.view(-1)))


def _decode_places(piece: torch.Tensor, p: _Piece) -> torch.Tensor:
    """The (chunks, kept) ascending places `_encode_places` wrote (int64)."""
    bitmap = _unpack(piece.narrow(0, p.low_bytes, p.high_bytes), p.rows * p.high_width, 1).view(p.rows, p.high_width)
    set_at = bitmap.nonzero()[:, 1]  # row by row, ascending in each
    if set_at.numel() != p.rows * p.kept:
        raise ValueError(f"cgx.DiLoCo: a sparse payload holds {set_at.numel()} places where {p.rows * p.kept} "
                         f"were sent: the replicas' plans differ")
    places = (set_at.view(p.rows, p.kept) - torch.arange(p.kept, device=piece.device)) << p.low_bits
    if p.low_bits:
        places |= _unpack(piece.narrow(0, 0, p.low_bytes), p.rows * p.kept, p.low_bits).view(p.rows, p.kept)
    return places


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`values` (non-negative, below 2**bits) at `bits` bits each, least significant
    first, in bytes."""
    shifts = torch.arange(bits, device=values.device)
    return _pack_stream(((values.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1))


def _pack_stream(stream: torch.Tensor) -> torch.Tensor:
    """A uint8 stream of 0 and 1, eight to a byte, the first in the least significant bit."""
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=stream.device)).to(torch.uint8)
    return (stream.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The `count` values `_pack` packed at `bits` bits each (int64)."""
    stream = ((packed.unsqueeze(1) >> torch.arange(8, device=packed.device, dtype=torch.uint8)) & 1).reshape(-1)
    stream = stream.narrow(0, 0, count * bits).view(count, bits).long()
    return (stream << torch.arange(bits, device=packed.device)).sum(1)
