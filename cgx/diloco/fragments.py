"""The fragments of a DiLoCo run: whole layers that sync together, each with its members
(synced parameters and their float32 global copies) and outer optimizer; and the synced
set they make, which follows what the inner optimizer trains (members join and leave a
fragment as its sync starts). Helpers for parameters and layers at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cgx.agreement import first_difference
from cgx.diloco.replicas import Replicas
from cgx.diloco.sparse import SparsePlan, TopK
from cgx.diloco.tensors import digest, local
from cgx.layers import CompressionPolicy, LayerSetting, Segment, all_raw, append_segment
from cgx.residuals import Residuals

PATTERNS = ("strided", "sequential")
Trained = list[tuple[str, tuple[int, ...]]]


@dataclass(eq=False)  # compared by identity: they hold tensors
class Member:
    """A synced parameter."""

    name: str
    param: torch.Tensor  # the replica's parameter (a DTensor under FSDP2)
    global_weight: torch.Tensor  # float32, the local shape (the shard under FSDP2)
    setting: LayerSetting


@dataclass(eq=False)
class Fragment:
    """Whole layers that sync together, and their sync: its start (the outer gradient's
    allreduce, with the agreement), its completion, and its application (outer step and
    merge). Its members change only when its sync starts (none of its syncs is in flight
    then)."""

    index: int
    offset: int  # syncs at the steps t with t % sync_every == offset
    top_k: TopK | None = None  # the outer gradients' sparsity (None: dense)
    members: list[Member] = field(default_factory=list)
    layout: list[Segment] = field(default_factory=list)  # over the fragment's flat outer gradient
    compressed: list[tuple[str, int, int]] = field(default_factory=list)  # (name, offset, numel)
    outer: torch.optim.SGD | None = None  # None while the fragment has no members
    numel: int = 0
    sparse: SparsePlan | None = None  # how its outer gradient travels with top_k (None: in an allreduce)
    syncs: int = 0  # syncs applied
    last_start: int = -1  # the inner step its last sync started at
    # The inner step this replica's next outer gradient of the fragment counts from: its last
    # sync's start here, or where its local weights restarted from the global ones (syncs.Weight).
    interval_start: int = 0

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def set_members(self, members: list[Member], outer_options: dict[str, Any],
                    momentum: dict[str, torch.Tensor] | None = None) -> None:
        """The fragment's members become `members`; those it kept keep their outer momentum,
        or all take `momentum`'s (name -> buffer) where it is given (a loaded state)."""
        self.members = members
        self.layout, self.compressed, self.numel = [], [], 0
        for m in members:
            numel = m.global_weight.numel()
            if m.setting.compressed and numel > 0:
                self.compressed.append((m.name, self.numel, numel))
            append_segment(self.layout, self.numel, numel, m.setting)
            self.numel += numel
        self.sparse = SparsePlan(self.layout, self.top_k) if self.top_k and not all_raw(self.layout) else None
        previous = None if momentum is not None else self.outer
        self.outer = torch.optim.SGD([m.global_weight for m in members], **outer_options) if members else None
        if previous is not None and self.outer is not None:
            kept = {id(m.global_weight) for m in members}
            for g, state in previous.state.items():
                if id(g) in kept:
                    self.outer.state[g] = state
        for m in members if momentum is not None else ():
            if m.name in momentum:
                self.outer.state[m.global_weight] = {"momentum_buffer": momentum[m.name].clone()}

    def change_members(self, leaving: set[str], joining: list[Member], outer_options: dict[str, Any],
                       residuals: Residuals) -> None:
        """At the sync's start: members named in `leaving` leave, taking their global
        weight (so equal on every replica) and dropping their momentum and residual;
        `joining` join with their global weights."""
        gone = [m for m in self.members if m.name in leaving]
        for m in gone:
            restore(m)
            residuals.pop(m.name, None)
        self.set_members([m for m in self.members if m not in gone] + joining, outer_options)

    def outer_momentum(self) -> dict[str, torch.Tensor]:
        """Each member's outer momentum buffer (copies), where it has one yet."""
        return {name: buffer.clone() for name, buffer in self.momentum_buffers().items()}

    def state_tensors(self) -> list[torch.Tensor]:
        """What every replica holds alike of the fragment after a sync: its global weights
        and outer momentum buffers, in member order."""
        return [m.global_weight for m in self.members] + list(self.momentum_buffers().values())

    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        """Each member's outer momentum buffer (the optimizer's own), where it has one yet."""
        if self.outer is None:
            return {}
        return {m.name: self.outer.state[m.global_weight]["momentum_buffer"] for m in self.members
                if self.outer.state[m.global_weight].get("momentum_buffer") is not None}


class Fragments:
    """The synced set of one replica: its fragments, and the members about to join or
    leave one. It follows what the inner optimizer trains: members no longer trained leave
    when their fragment's sync next starts, newly trained parameters join then."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: CompressionPolicy,
                 fragments: int, pattern: str, sync_every: int, top_k: TopK | None,
                 outer_options: dict[str, Any]) -> None:
        """The fragments of the parameters `optimizer` trains, whole layers each."""
        self._model, self._optimizer, self._policy = model, optimizer, policy
        self._outer_options = outer_options
        params = synced_parameters(model, optimizer)
        # Against all the model's layers: frozen ones may join later, into empty fragments.
        every_layer = layers_of(dict(model.named_parameters()))
        if fragments > len(every_layer):
            raise ValueError(f"cgx.DiLoCo: fragments={fragments} is more than the model's "
                             f"{len(every_layer)} layers with parameters")
        settings = policy.resolve(model)
        assignment = assign_fragments(params, layers_of(params), fragments, pattern)
        self.all = [Fragment(p, p * sync_every // fragments, top_k) for p in range(fragments)]
        for fragment, names in zip(self.all, assignment):
            fragment.set_members([new_member(n, params[n], settings[n]) for n in names], outer_options)
        if top_k is not None:  # against every layer of the model: a frozen one may be trained later
            largest = max((local(p).numel() for n, p in model.named_parameters() if self.setting(n, p).compressed),
                          default=0)
            if largest == 0:
                raise ValueError("cgx.DiLoCo: top_k with no compressed layer in the model (the policy keeps every "
                                 "layer exact): sparse outer gradients are for compressed layers; leave top_k=None")
            if top_k.chunk > largest:
                raise ValueError(f"cgx.DiLoCo: top_k's chunk={top_k.chunk} is larger than every compressed layer "
                                 f"(at most {largest} values): each layer would be one chunk; choose a chunk of at "
                                 f"most {largest}")
        self.joining: dict[str, tuple[int, Member]] = {}  # name -> (fragment, member): joins at its start
        self.leaving: set[str] = set()  # members that leave when their fragment's sync next starts

    def __iter__(self):
        return iter(self.all)

    def __getitem__(self, index: int) -> Fragment:
        return self.all[index]

    def __len__(self) -> int:
        return len(self.all)

    def members(self) -> list[Member]:
        """Every synced parameter: the fragments' members, then those about to join."""
        return [m for f in self.all for m in f.members] + [m for _, m in self.joining.values()]

    def setting(self, name: str, param: torch.Tensor) -> LayerSetting:
        return self._policy.setting_for(name, self._model.get_submodule(name.rpartition(".")[0]), param)

    def member(self, name: str, param: torch.Tensor) -> Member:
        return new_member(name, param, self.setting(name, param))

    def follow(self, trained: Trained, replicas: Replicas) -> None:
        """Makes the synced set follow `trained`, which every replica agreed on: members
        no longer trained leave when their fragment's sync next starts, and newly trained
        parameters start from group rank 0's values now and join a fragment when its
        sync next starts."""
        wanted = {name for name, _ in trained}
        members = {m.name for f in self.all for m in f.members}
        self.leaving = members - wanted
        for name in [n for n in self.joining if n not in wanted]:
            restore(self.joining.pop(name)[1])
        new = [name for name, _ in trained if name not in members and name not in self.joining]
        if not new:
            return
        params = dict(self._model.named_parameters())
        replicas.broadcast([params[n] for n in new])
        for names in layers_of({n: params[n] for n in new}).values():
            fragment = self._fragment_for(names[0])
            for name in names:
                self.joining[name] = (fragment, self.member(name, params[name]))

    def _fragment_for(self, name: str) -> int:
        """Where a newly trained parameter goes: to its layer's fragment where another of
        the layer's parameters is synced, else to the fragment with the fewest elements
        (the lowest index on a tie); from what every replica agreed, so alike on all."""
        layer = name.rpartition(".")[0]
        planned = [(f.index, m.name, m.param.numel()) for f in self.all for m in f.members
                   if m.name not in self.leaving]
        planned += [(index, n, m.param.numel()) for n, (index, m) in self.joining.items()]
        for index, other, _ in planned:
            if other.rpartition(".")[0] == layer:
                return index
        load = [0] * len(self.all)
        for index, _, numel in planned:
            load[index] += numel
        return min(range(len(load)), key=lambda index: (load[index], index))

    def at_sync_start(self, fragment: Fragment, residuals: Residuals,
                      state: bool) -> tuple[bool, Trained, int, int]:
        """Applies the fragment's pending joins and leaves as its sync starts. Returns
        whether any (leaving members take their global weights); what the inner optimizer
        trains now with how many tensors it holds that are not the model's
        (trained_parameters); and, with `state`, a digest of the fragment's global weights
        and outer momentum (0 without): the sync's agreement carries all three."""
        leaving = {m.name for m in fragment.members if m.name in self.leaving}
        joining = [m for index, m in self.joining.values() if index == fragment.index]
        if leaving or joining:
            self.leaving -= leaving
            for m in joining:
                del self.joining[m.name]
            fragment.change_members(leaving, joining, self._outer_options, residuals)
        digested = digest(fragment.state_tensors()) if state and fragment.members else 0
        return bool(leaving or joining), *trained_parameters(self._model, self._optimizer), digested

    # ---- what the replicas build alike, and the state a replica sends to one taking it

    def construction(self, schedule: dict[str, Any]) -> dict[str, Any]:
        """What every replica of a run must build alike (with its `schedule`'s fields),
        compared as an elastic round forms."""
        model = self._model
        return {**schedule,
                "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()],
                # Every parameter's, frozen or not: the run may have unfrozen some.
                "settings": [(n, self.setting(n, p)) for n, p in model.named_parameters()],
                "trained parameters": trained_parameters(model, self._optimizer)[0]}

    def start_together(self, replicas: Replicas, schedule: dict[str, Any]) -> None:
        """The run's start: the replicas agree on how they built DiLoCo (`schedule`, the
        fragments, the model; ValueError on every rank where they differ), and every one
        starts from group rank 0's weights, frozen ones too, as DDP does."""
        difference = first_difference(None, all_gather=replicas.all_gather, fields={
            **schedule,
            "fragments and layouts": [(f.names, f.layout) for f in self.all],
            "parameters": [(n, tuple(p.shape), p.dtype) for n, p in self._model.named_parameters()],
        })
        if difference:
            raise ValueError(f"cgx.DiLoCo: the ranks of the group were given different settings: "
                             f"{difference}; every replica must build DiLoCo alike on the same model")
        replicas.broadcast([p for _, p in self._model.named_parameters()])
        with torch.no_grad():
            for fragment in self.all:
                for m in fragment.members:
                    m.global_weight.copy_(local(m.param))

    def layout(self) -> dict[str, Any]:
        """The synced set's state but its tensors: what a replica taking it needs."""
        return {
            "fragments": [f.names for f in self.all],
            "offsets": [f.offset for f in self.all],  # fixed at construction (sync_every may change)
            "syncs": [f.syncs for f in self.all],
            "last_start": [f.last_start for f in self.all],
            "momentum": [sorted(f.outer_momentum()) for f in self.all],
            # In the order members join a fragment (model order, as follow() adds them).
            "joining": [(name, index) for name, (index, _) in self.joining.items()],
            "leaving": sorted(self.leaving),
            "frozen": self._frozen(),
        }

    def _frozen(self) -> list[str]:
        """The parameters neither synced nor trained here: equal on every replica."""
        synced = {m.name for f in self.all for m in f.members} | set(self.joining)
        synced |= {name for name, _ in trained_parameters(self._model, self._optimizer)[0]}
        return [name for name, _ in self._model.named_parameters() if name not in synced]

    def state_tensors(self, frozen: list[str]) -> list[torch.Tensor]:
        """The run's state that a replica taking it receives, in an order every replica
        with the same layout shares: global weights, outer momentum buffers, and the
        `frozen` parameters (the reference's list)."""
        momentum = [t for f in self.all for t in f.momentum_buffers().values()]
        params = dict(self._model.named_parameters())
        joining = [self.joining[name][1] for name in sorted(self.joining)]
        members = [m for f in self.all for m in f.members] + joining
        return [m.global_weight for m in members] + momentum + [params[name] for name in frozen]

    def take_layout(self, layout: dict[str, Any]) -> None:
        """Takes another replica's layout (its layout()); the tensors follow, in
        state_tensors' order."""
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for fragment, names, offset, syncs, last_start, momentum in zip(
                    self.all, layout["fragments"], layout["offsets"], layout["syncs"], layout["last_start"],
                    layout["momentum"]):
                fragment.set_members([self.member(n, params[n]) for n in names], self._outer_options, momentum={})
                fragment.offset, fragment.syncs, fragment.last_start = offset, syncs, last_start
                for m in fragment.members:
                    if m.name in momentum:
                        fragment.outer.state[m.global_weight] = {"momentum_buffer": torch.zeros_like(m.global_weight)}
            self.joining = {name: (index, self.member(name, params[name])) for name, index in layout["joining"]}
        self.leaving = set(layout["leaving"])

    def start_intervals(self, step: int) -> None:
        """Every fragment's next outer gradient holds the inner steps from `step` on (the
        run's start; the local weights restarted from the global ones)."""
        for fragment in self.all:
            fragment.interval_start = step

    def restart_local_weights(self) -> None:
        with torch.no_grad():
            for m in self.members():
                local(m.param).copy_(m.global_weight)

    # ---- checkpoints

    def state(self) -> dict[str, Any]:
        """The synced set's part of DiLoCo.state_dict()."""
        return {
            "fragments": [f.names for f in self.all],
            "joining": {name: index for name, (index, _) in self.joining.items()},
            "leaving": sorted(self.leaving),
            "global_weights": {m.name: m.global_weight.clone() for m in self.members()},
            "outer_momentum": {name: buffer for f in self.all for name, buffer in f.outer_momentum().items()},
            "syncs": [f.syncs for f in self.all],
            "interval_starts": [f.interval_start for f in self.all],
            "last_starts": [f.last_start for f in self.all],
        }

    def load(self, state: dict[str, Any]) -> None:
        """Takes a checked state()'s members, global weights, momentum and pending changes."""
        params = dict(self._model.named_parameters())

        def loaded(name: str) -> Member:
            m = self.member(name, params[name])
            m.global_weight.copy_(state["global_weights"][name])
            return m

        with torch.no_grad():
            for fragment, names in zip(self.all, state["fragments"]):
                fragment.set_members([loaded(n) for n in names], self._outer_options,
                                     momentum=state["outer_momentum"])
            self.joining = {name: (index, loaded(name)) for name, index in state["joining"].items()}
        self.leaving = set(state["leaving"])
        for fragment, syncs in zip(self.all, state.get("syncs", [0] * len(self.all))):
            fragment.syncs = syncs
        # A state of before them weighs its next syncs as whole intervals (0 and -1: the steps
        # since the run's start, on every replica alike).
        for fragment, start, last in zip(self.all, state.get("interval_starts", [0] * len(self.all)),
                                         state.get("last_starts", [-1] * len(self.all))):
            fragment.interval_start, fragment.last_start = start, last


def new_member(name: str, param: torch.Tensor, setting: LayerSetting) -> Member:
    with torch.no_grad():
        return Member(name, param, local(param).detach().float().clone(), setting)


def restore(member: Member) -> None:
    """A parameter that is no longer synced keeps its global weight: equal on every replica."""
    with torch.no_grad():
        local(member.param).copy_(member.global_weight)

def trained_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """(name, shape) of the model's parameters the optimizer updates (in the optimizer,
    requiring grad), in model order; and how many tensors it holds that are not the model's."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = list(model.named_parameters())
    strangers = len(held - {id(p) for _, p in named})
    return [(n, tuple(p.shape)) for n, p in named if id(p) in held and p.requires_grad], strangers


def synced_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's parameters the optimizer updates, by name, in model order; ValueError
    if the optimizer holds parameters that are not the model's, or none of them."""
    trained, strangers = trained_parameters(model, optimizer)
    if strangers:
        raise ValueError(f"cgx.DiLoCo: inner_optimizer updates {strangers} tensor(s) that are not "
                         f"parameters of the model: give the optimizer of this model's parameters")
    if not trained:
        raise ValueError("cgx.DiLoCo: inner_optimizer updates none of the model's trainable parameters")
    params = dict(model.named_parameters())
    return {n: params[n] for n, _ in trained}


def layers_of(params: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Parameter names grouped by the module that owns them, in model order."""
    layers: dict[str, list[str]] = {}
    for name in params:
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    return layers


def assign_fragments(params: dict[str, torch.Tensor], layers: dict[str, list[str]], fragments: int,
            pattern: str) -> list[list[str]]:
    """The parameter names of each fragment, whole layers each (see DiLoCo's
    `fragment_pattern`). A layer's size is its parameters' (global) number of elements, the
    same on every rank."""
    members = list(layers.values())
    choice = split_layers([sum(params[n].numel() for n in names) for names in members], fragments, pattern)
    return [[n for names, p in zip(members, choice) if p == q for n in names] for q in range(fragments)]


def split_layers(sizes: list[int], fragments: int, pattern: str) -> list[int]:
    """The fragment of each layer, given the layers' sizes in model order. Either pattern
    keeps every fragment within 1/P of the total plus one layer (list scheduling: a layer
    goes to a fragment that holds at most the average)."""
    load = [0] * fragments
    taken = [0] * fragments
    choice = []
    if pattern == "strided":
        turn = 0
        for size in sizes:  # the least loaded fragment (the fewest layers, the next in turn)
            p = min(range(fragments), key=lambda q: (load[q], taken[q], (q - turn) % fragments))
            choice.append(p)
            load[p] += size
            taken[p] += 1
            turn = (p + 1) % fragments
        return choice
    total, p, so_far = sum(sizes), 0, 0
    for i, size in enumerate(sizes):
        choice.append(p)
        so_far += size
        layers_left = len(sizes) - 1 - i
        if p < fragments - 1 and (so_far * fragments >= (p + 1) * total or layers_left == fragments - 1 - p):
            p += 1
    return choice