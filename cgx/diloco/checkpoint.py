"""DiLoCo's checkpoints: the syncs in flight as a state_dict holds them, and the checks a
state passes before it loads (ValueError naming what does not fit)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from cgx.counters import RENAMED
from cgx.diloco.fragments import Fragments
from cgx.diloco.replicas import SYNC, Agreement, Replicas, current_rows, fresh_stats
from cgx.diloco.syncs import Sync, Weight
from cgx.diloco.tensors import local
from cgx.residuals import Residuals, check_same_place

STATE_KEYS = ("rank", "world_size", "fragments", "joining", "leaving", "step", "global_weights", "outer_momentum",
              "residuals", "in_flight", "stats")


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def saved(replicas: Replicas, fragments: Fragments, step: int, in_flight: list[Sync]) -> dict[str, Any]:
    """A replica's state_dict(): the synced set's state, this rank's place, residuals and
    stats, the step and the syncs in flight (completed: their average is kept)."""
    return {**replicas.place(), **fragments.state(), "step": step, "residuals": replicas.residuals.cloned(),
            "in_flight": _in_flight_state(in_flight), "stats": copy.deepcopy(replicas.stats)}


def loaded(state: dict[str, Any], replicas: Replicas, fragments: Fragments,
           in_flight: list[Sync]) -> tuple[int, list[Sync]]:
    """Loads a checked state (check_state) into the synced set and the replicas' residuals
    and stats, once the replaced syncs in flight (`in_flight`) completed, unapplied.
    Returns the state's step and syncs in flight."""
    for sync in in_flight:
        replicas.wait(sync.agreement)
        if sync.work is not None:
            sync.work.wait()
    fragments.load(state)
    replicas.residuals = Residuals({n: r.clone() for n, r in state["residuals"].items()})
    # Older names too, and counters added since (none counted).
    replicas.stats = {**fresh_stats(), **{RENAMED.get(k, k): copy.deepcopy(v) for k, v in state["stats"].items()}}
    return int(state["step"]), _in_flight_of(state, fragments)


def _in_flight_state(in_flight: list[Sync]) -> list[dict[str, Any]]:
    """The syncs in flight (completed: their averaged outer gradient is kept), as saved."""
    return [{"fragment": s.fragment.index, "due": s.due, "outer_gradient": _clone(s.outer_gradient),
             "residual": _clone(s.residual), "drift": _clone(s.drift), "step": s.agreement.step,
             "trained": s.agreement.trained, "agreement": s.agreement.rows.clone(),
             "weight": None if s.weight is None else [s.weight.steps, s.weight.unit]}
            for s in in_flight]


def _in_flight_of(state: dict[str, Any], fragments: Fragments) -> list[Sync]:
    """A checked state's syncs in flight, completed, to be applied at their step."""
    return [Sync(fragments.all[s["fragment"]], s["due"],
                 Agreement(SYNC, s["step"], s["trained"], current_rows(s["agreement"]), None),
                 _clone(s["outer_gradient"]), _clone(s["residual"]), None, drift=_clone(s.get("drift")),
                 weight=None if s.get("weight") is None else Weight(*s["weight"]))
            for s in state["in_flight"]]


def check_state(state: dict[str, Any], replicas: Replicas, fragments: Fragments, model: torch.nn.Module) -> None:
    """ValueError naming what in `state` does not fit this DiLoCo, its model or place."""
    what = "cgx.DiLoCo.load_state_dict"
    missing = [k for k in STATE_KEYS if k not in (state if isinstance(state, dict) else {})]
    if missing:
        raise ValueError(f"{what}: missing {missing} (expected the dict of DiLoCo.state_dict())")
    if len(state["fragments"]) != len(fragments.all):
        raise ValueError(f"{what}: the state has {len(state['fragments'])} fragments, this DiLoCo "
                         f"{len(fragments.all)}")
    if state["residuals"] or any(s["residual"] is not None for s in state["in_flight"]):
        check_same_place(state, replicas.place(), what)
    if state["in_flight"] and state["world_size"] != replicas.size:
        raise ValueError(f"{what}: the state has syncs in flight of a group of {state['world_size']} ranks, "
                         f"loaded in one of {replicas.size}")
    params = dict(model.named_parameters())
    synced = [n for names in state["fragments"] for n in names] + list(state["joining"])
    for name in synced:
        if name not in params:
            raise ValueError(f"{what}: the state syncs {name!r}, a parameter this model does not have: build "
                             f"the model (and add its optimizer's param groups) as when the state was saved")
    for key in ("global_weights", "outer_momentum", "residuals"):
        for name, tensor in state[key].items():
            held = local(params[name]) if name in synced else None
            if held is None or tensor.shape != ((held.numel(),) if key == "residuals" else held.shape):
                raise ValueError(f"{what}: {key}[{name!r}] does not fit this model's parameter "
                                 f"(a checkpoint of another model or shard)")
    if set(state["global_weights"]) != set(synced):
        raise ValueError(f"{what}: global_weights lacks {sorted(set(synced) - set(state['global_weights']))}")
