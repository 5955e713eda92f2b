"""What each rank tells the others of its machine when a group is created (its GPU, its
kernel, its CPUs and torch's intra-op threads), and what the group learns from that: the
exact path's backend for CUDA tensors, and whether the ranks of one machine ask for more
threads than it has CPUs."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankMachine:
    gpu: str  # the UUID of the rank's current GPU ("" without CUDA or NCCL)
    # The kernel's boot id: alike for every process of one machine, also across network
    # namespaces and containers (emulated hosts share the machine's CPUs).
    kernel: str
    cpus: tuple[int, ...]  # the CPUs the rank may run on (its affinity)
    threads: int  # torch.get_num_threads() when the group was created

    @classmethod
    def this_rank(cls) -> RankMachine:
        return cls(_this_gpu(), _boot_id(), tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankMachine:
        fields = json.loads(text)
        return cls(**{**fields, "cpus": tuple(fields["cpus"])})


def _this_gpu() -> str:
    """The identity of this rank's current GPU (its UUID: two ranks that see one GPU
    under different indices still match), or "" without CUDA or NCCL."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return ""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # no procfs: every rank counts as a machine of its own
        return f"unknown-{os.getpid()}"


def cuda_exact_backend(gpus: list[str]) -> str:
    """The exact path's backend for CUDA tensors, given each rank's GPU ("" for none):
    NCCL when every rank has a GPU of its own, else Gloo, which stages CUDA tensors
    through host memory (NCCL refuses two ranks on one GPU)."""
    if all(gpus) and len(set(gpus)) == len(gpus):
        return "nccl"
    return "gloo"


def oversubscription(machines: list[RankMachine], rank: int) -> str | None:
    """A warning for the first rank of a machine whose ranks ask for more intra-op threads
    between them than the CPUs they may run on, some of them several, else None.

    torch's OpenMP threads spin while they wait for each other at the end of every
    parallel op; with more of them than CPUs, a thread spins through its time slice
    waiting for one the scheduler gave another rank's. Measured on a 2-core VM with 2
    ranks at torch's default 2 threads: 3x slower steps on average, single steps 20x,
    with or without cgx (docs/launching.md)."""
    mine = machines[rank]
    same = [r for r, m in enumerate(machines) if m.kernel == mine.kernel]
    cpus = set().union(*(machines[r].cpus for r in same))
    threads = sum(machines[r].threads for r in same)
    # Ranks of one thread each share the CPUs in turn: no thread waits for another.
    if rank != same[0] or len(same) < 2 or threads <= len(cpus) or all(machines[r].threads == 1 for r in same):
        return None
    each = sorted({machines[r].threads for r in same})
    fair = max(1, len(cpus) // len(same))
    return (f"cgx: {len(same)} ranks of this group run on this machine's {len(cpus)} CPUs with "
            f"{threads} intra-op threads between them (torch.get_num_threads(): "
            f"{', '.join(map(str, each))}). torch's threads spin while they wait for each other, "
            f"and with more threads than CPUs steps can be several times slower. Call "
            f"torch.set_num_threads({fair}) in every rank before training, or set "
            f"OMP_NUM_THREADS={fair} (torchrun sets 1 where it starts several ranks a machine).")


def warn_if_oversubscribed(machines: list[RankMachine], rank: int) -> None:
    message = oversubscription(machines, rank)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
