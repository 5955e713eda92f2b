"""What DiLoCo's pieces do to tensors alike: a rank's part of a parameter, tensors moved
by a collective one dtype at a time, and a digest of their bits."""

from __future__ import annotations

import hashlib
from typing import Callable

import torch


def local(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: the local shard of an FSDP2 DTensor, else the
    parameter itself (in-place writes reach the parameter either way)."""
    return param.to_local() if hasattr(param, "to_local") else param


def move_by_dtype(tensors: list[torch.Tensor], move: Callable[[torch.Tensor], None]) -> int:
    """For each dtype among `tensors` (in order): one flat copy of them, `move(flat)` (a
    collective that sends it or fills it), and its values back into the tensors. Returns
    the bytes of the flat copies."""
    moved = 0
    with torch.no_grad():
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            move(flat)
            moved += flat.numel() * flat.element_size()
            offset = 0
            for t in same:
                t.copy_(flat.narrow(0, offset, t.numel()).view_as(t))
                offset += t.numel()
    return moved


def digest(tensors: list[torch.Tensor]) -> int:
    """A nonzero 64-bit digest of the tensors' bytes (their values, bit for bit)."""
    hashed = hashlib.blake2b(digest_size=8)
    for t in tensors:
        hashed.update(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(hashed.digest(), "little") or 1
