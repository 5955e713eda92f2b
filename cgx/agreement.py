"""Checks that the ranks of a group made the same call before any collective of it runs.

Ranks that install different settings (8 bits on one, 32 on another; other layouts)
would meet in mismatched collectives and fail at the timeout, or decode garbage. One
all-gather of the call's fields (int64: integers as they are, floats by their bits,
anything else by a digest of its repr) finds the first difference on every rank alike.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["first_difference"]


def first_difference(group: dist.ProcessGroup | None, fields: dict[str, object],
                     all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None) -> str | None:
    """None where every rank of `group` gave the same `fields` (same names, same order);
    else the first difference, as ``"name A here, B on group rank r"`` (or ``"name differ
    (against group rank r)"`` for digested values). `all_gather` (every rank's copy of a
    tensor, in rank order) replaces the group's where the ranks have no ProcessGroup (an
    elastic run's round)."""
    mine = torch.tensor([_encode(v) for v in fields.values()], dtype=torch.int64)
    if all_gather is None:
        everyone = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(everyone, mine, group=group)
    else:
        everyone = all_gather(mine)
    for peer, theirs in enumerate(everyone):
        differs = (mine != theirs).nonzero()
        if differs.numel():
            field = int(differs[0])
            name, value = list(fields.items())[field]
            return _describe(name, value, int(theirs[field]), peer)
    return None


def _encode(value: object) -> int:
    if isinstance(value, int):  # bool included
        return int(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def _describe(name: str, mine: object, theirs: int, peer: int) -> str:
    if isinstance(mine, bool):
        shown = bool(theirs)
    elif isinstance(mine, int):
        shown = theirs
    elif isinstance(mine, float):
        shown = struct.unpack("<d", struct.pack("<q", theirs))[0]
    else:
        return f"{name} differ (against group rank {peer})"
    return f"{name} {mine!r} here, {shown!r} on group rank {peer}"
