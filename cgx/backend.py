"""Creates ProcessGroupCGX for torch.distributed (the registered factory), finds it
behind a group, and lets a caller ask for exact calls on a compressing group."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import socket
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from cgx import _C, mpi
from cgx.config import VARIABLES, Config, from_env, read
from cgx.gloo_group import new_gloo_group
from cgx.machine import RankMachine, cuda_exact_backend, warn_if_oversubscribed

# Settings every rank of a group must share (the host name, the segment names' tag and the
# codec's threads, which change no bit, are each rank's own).
_OWN_FIELDS = ("hostname", "shm_name_tag", "codec_threads")
_SHARED_FIELDS = tuple(v.field for v in VARIABLES if v.field not in _OWN_FIELDS)


# As Python exits, before it finalizes: cgx's threads finish and release what their calls
# held (csrc/backend/thread_tasks.h), else a release that needs the GIL then ends the
# process with std::terminate. A completed call releases in microseconds; a call still
# waiting on a peer is not waited for past this bound (the process exits as it would).
_EXIT_WAIT_SECONDS = 1.0
atexit.register(_C.wait_for_thread_tasks, _EXIT_WAIT_SECONDS)

# The settings C++ holds as enums, by the name cgx.config gives them.
_ENUMS = {"scheme": _C.Scheme, "inner_communicator": _C.InnerCommunicator, "cross_communicator": _C.CrossCommunicator,
          "inner_reduction": _C.ReductionAlgorithm, "cross_reduction": _C.ReductionAlgorithm}


def to_settings(config: Config) -> _C.Settings:
    """The C++ Settings of a config: every field of the table, set (C++ has no defaults)."""
    settings = _C.Settings()
    for var in VARIABLES:
        value = getattr(config, var.field)
        if var.field in _ENUMS:
            value = _ENUMS[var.field].__members__[value]
        elif var.field == "hostname":
            value = value or socket.gethostname()
        elif var.field == "shm_name_tag":
            value = value or ""
        elif var.field == "codec_threads":
            value = value or min(torch.get_num_threads(), _C.MAX_CODEC_THREADS)
        setattr(settings, var.field, value)
    return settings


def create_backend(dist_options, backend_options=None) -> _C.ProcessGroupCGX:
    """torch.distributed's factory for backend "cgx" (registered with extended_api=True).

    Settings come from ``pg_options`` when it is a :class:`cgx.Config`
    (``dist.new_group(backend="cgx", pg_options=cgx.Config(bits=4))``), else from the
    CGX_* variables (ValueError on a bad one, or on MPI asked for where it cannot run).
    Creates the backends that carry the exact path on their own prefixes of the group's
    store (Gloo; NCCL too for CUDA tensors where every rank has a GPU of its own), and
    connects the compressed path (inner and cross communicators).
    """
    if backend_options is not None and not isinstance(backend_options, Config):
        raise TypeError(
            f"cgx: pg_options must be a cgx.Config, got {type(backend_options).__name__}"
        )
    return new_backend(dist_options.store, dist_options.group_rank, dist_options.group_size, dist_options.timeout,
                       backend_options)


def new_backend(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                config: Config | None = None, give_up: GiveUp | None = None) -> _C.ProcessGroupCGX:
    """A ProcessGroupCGX of `size` ranks on `store`, as :func:`create_backend` makes a
    group's (`config`: its settings; None: the CGX_* variables; `give_up`: see
    :func:`gather`, for the settings' exchange, where a rank that died is met first)."""
    # Every rank counts the groups it created on this store prefix, so the n-th one gets
    # fresh keys even where an earlier one (destroyed, re-initialized) left keys behind.
    incarnation = store.add(f"cgx/incarnation/{rank}", 1)
    cgx_store = dist.PrefixStore(f"cgx/{incarnation}/", store)
    # A bad CGX_* value on one rank is told to every rank (they would otherwise wait for
    # its settings until the timeout).
    try:
        config = from_env() if config is None else with_process_settings(config)
        problem = None
    except ValueError as e:
        config, problem = None, str(e)
    config = _check_same_config(cgx_store, rank, size, config, problem, timeout, give_up)
    if config.uses_mpi:
        mpi.require(config)
    exact = new_gloo_group(dist.PrefixStore(f"gloo/{incarnation}/", store), rank, size, timeout)
    exact_cuda = None
    machines = [RankMachine.from_json(m) for m in
                gather(cgx_store, "machine", rank, size, RankMachine.this_rank().to_json(), timeout, give_up)]
    warn_if_oversubscribed(machines, rank)
    if cuda_exact_backend([m.gpu for m in machines]) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl_store = dist.PrefixStore(f"nccl/{incarnation}/", store)
        exact_cuda = dist.ProcessGroupNCCL(nccl_store, rank, size, options)
    return _C.ProcessGroupCGX(cgx_store, rank, size, timeout, exact, exact_cuda, to_settings(config))


def with_process_settings(config: Config) -> Config:
    """`config` with the process's own CGX_SHM_NAME_TAG where it names none (ValueError
    naming the variable on a bad value)."""
    if config.shm_name_tag is not None:
        return config
    return dataclasses.replace(config, shm_name_tag=read("shm_name_tag"))


def shared_settings(config: Config) -> dict[str, Any]:
    """The settings of `config` that every rank of a group must share, by variable name."""
    return {v.name: getattr(config, v.field) for v in VARIABLES if v.field in _SHARED_FIELDS}


# Called while a gather() waits, with when the wait started and a function that lists the
# ranks that have not written yet; raises (DistStoreError) to end the wait.
GiveUp = Callable[[float, Callable[[], list[int]]], None]


def gather(store: dist.Store, key: str, rank: int, size: int, value: str, timeout: datetime.timedelta,
           give_up: GiveUp | None = None) -> list[str]:
    """Every rank's `value` under `key`, waiting at most `timeout` for them
    (DistStoreError past it: a rank that died before it wrote). With `give_up`, the
    wait polls and asks it every few milliseconds whether to end sooner."""
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(size)]
    if give_up is None:
        store.wait(keys, timeout)
    else:
        started = time.monotonic()
        while not store.check(keys):
            if time.monotonic() > started + timeout.total_seconds():
                raise dist.DistStoreError(f"cgx: not every rank wrote {key!r} within {timeout}")
            give_up(started, lambda: [r for r in range(size) if not store.check([keys[r]])])
            time.sleep(0.005)
    return [store.get(k).decode() for k in keys]


def _check_same_config(store: dist.Store, rank: int, size: int, config: Config | None,
                       problem: str | None, timeout: datetime.timedelta, give_up: GiveUp | None) -> Config:
    """Ranks with different settings would take different paths and meet only at the
    timeout: compare them at creation instead, and fail on every rank alike, also where
    one rank's settings could not be read (`problem`). Returns this rank's config."""
    mine = json.dumps({"problem": problem} if problem else list(shared_settings(config).values()))
    configs = [json.loads(c) for c in gather(store, "config", rank, size, mine, timeout, give_up)]
    bad = [(r, c["problem"]) for r, c in enumerate(configs) if isinstance(c, dict)]
    if bad:
        r, message = bad[0]
        others = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        raise ValueError(f"cgx: bad configuration on rank {r}{others}: {message}")
    for r in range(1, size):
        for field, a, b in zip(_SHARED_FIELDS, configs[0], configs[r]):
            if a != b:
                name = next(v.name for v in VARIABLES if v.field == field)
                raise ValueError(
                    f"cgx: ranks of the group disagree on {name}: rank 0 has {a!r}, "
                    f"rank {r} has {b!r}"
                )
    return config


def resolve_group(group: dist.ProcessGroup | None, what: str = "cgx", when: str = "first") -> dist.ProcessGroup:
    """`group`, or the default group for None; RuntimeError naming `what` (the caller)
    where the default group does not exist yet (`when`: when it must be made)."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: the default process group does not exist yet: call "
                           f"torch.distributed.init_process_group {when}")
    return dist.group.WORLD


def get_backend(group: dist.ProcessGroup | None = None) -> _C.ProcessGroupCGX:
    """The ProcessGroupCGX behind a "cgx" group (the default group when None)."""
    backend = resolve_group(group)._get_backend(torch.device("cpu"))
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps backends in a checking wrapper.
    backend = getattr(backend, "wrapped_pg", backend)
    if not isinstance(backend, _C.ProcessGroupCGX):
        raise ValueError(f"group is not a cgx group (its CPU backend is {type(backend).__name__})")
    return backend


def stats(group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """This rank's compressed-allreduce totals on `group`: calls, bytes_sent and
    uncompressed_bytes (what the same algorithm would send without compression); the same
    under "allgather" and "reduce_scatter"; cross_host_bytes; and under "auto" the way
    CGX_COMPRESSION_AUTO sends each size class of allreduce, with the timings it compared
    (docs/configuration.md)."""
    return get_backend(group).stats()


@contextlib.contextmanager
def exact() -> Iterator[None]:
    """Allreduces this thread issues inside the block take the exact path on every cgx
    group, whatever their dtype and size: the result equals Gloo's.

    For what must not be quantized on a group that compresses (metrics, loss averaging)::

        with cgx.exact():
            dist.all_reduce(loss_sum)

    Every rank must issue the call inside the block (the path is part of the call, like
    its size). Only the calling thread is affected. :func:`cgx.cgx_hook` keeps the
    per-layer plan it sends with each bucket, inside a block or not. Blocks nest.
    """
    previous = _C.set_exact_on_this_thread(True)
    try:
        yield
    finally:
        _C.set_exact_on_this_thread(previous)
