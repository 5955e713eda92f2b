"""Error-feedback residuals, as the DDP hook, qsdp and DiLoCo keep them.

A residual is what this rank's quantizations dropped from one layer (or one FSDP2 unit):
a flat float32 tensor kept under the layer's name, added to the next call's values and
replaced by what that call dropped. A call that carries several layers takes them as
one flat buffer (:meth:`Residuals.gather`) and gives it back filled by the collective
(:meth:`Residuals.keep`).

Residuals are this rank's own: two-level feedback records what the rank dropped as the
owner of some chunks of the sums, and which chunks a rank owns depends on its rank and
the group's size. A checkpoint therefore records where it was saved (:func:`place`) and
loads there only (:func:`check_same_place`), else the error says how to resume without
them.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["Residuals", "place", "check_same_place"]


class Residuals(dict):
    """Layer name -> residual (flat float32). A dict, so what a user or a checkpoint
    reads and writes is plain; the two methods lay residuals into a call's buffer and
    take them back out."""

    def gather(self, numel: int, entries: Iterable[tuple], device: torch.device) -> torch.Tensor:
        """A float32 buffer of `numel` values: zero, but for each entry ``(name, offset,
        layer_numel, ...)`` the residual kept under its name (one that does not have the
        layer's size, from before the layer changed, is left out)."""
        flat = torch.zeros(numel, dtype=torch.float32, device=device)
        for name, offset, layer_numel, *_ in entries:
            kept = self.get(name)
            if kept is not None and kept.numel() == layer_numel:
                flat.narrow(0, offset, layer_numel).copy_(kept.reshape(-1))
        return flat

    def keep(self, flat: torch.Tensor, entries: Iterable[tuple]) -> None:
        """After the call filled `flat`: each entry's residual (copies: views would keep,
        and pickle, the whole buffer)."""
        for name, offset, layer_numel, *_ in entries:
            self[name] = flat.narrow(0, offset, layer_numel).clone()

    def cloned(self) -> dict[str, torch.Tensor]:
        """A plain dict of copies, for a state_dict."""
        return {name: residual.clone() for name, residual in self.items()}


def place(group: dist.ProcessGroup) -> dict[str, Any]:
    """Where this rank's residuals belong, as a state_dict records it: its rank in `group`
    (the group its residuals were made in) and the group's size, and its global rank (two
    processes can hold one rank of two groups of the same size: DDP or FSDP2 inside each
    host of a per-host DiLoCo, HSDP's replicas)."""
    return {"rank": dist.get_rank(group), "world_size": group.size(), "global_rank": dist.get_rank()}


def check_same_place(state: dict[str, Any], here: dict[str, Any], what: str) -> None:
    """ValueError naming the difference unless `state` (with the saving rank's "rank" and
    "world_size", and "global_rank" where it has one; None where unknown) was saved on this
    rank of a group of this size, by the process of this global rank (`here`: this
    rank's :func:`place`)."""
    if state["world_size"] is not None and state["world_size"] != here["world_size"]:
        raise ValueError(
            f"{what}: the state was saved in a group of {state['world_size']} ranks, loaded in "
            f"one of {here['world_size']}; its error-feedback residuals belong to that group's ranks. "
            f"To resume at another size, load it with state['residuals'] = {{}} (feedback "
            f"restarts from zero; the rest carries over)"
        )
    saved = (state["rank"], state.get("global_rank"))
    if (saved[0] is not None and saved[0] != here["rank"]) or (
            None not in (saved[1], here["global_rank"]) and saved[1] != here["global_rank"]):
        raise ValueError(
            f"{what}: this is the state of rank {saved[0]} of its group"
            f"{'' if saved[1] is None else f' (global rank {saved[1]})'}, loaded on rank {here['rank']} "
            f"(global rank {here['global_rank']}); error-feedback residuals are per rank, so every rank "
            f"must save and load its own state_dict()"
        )
