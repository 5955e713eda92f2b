"""Runs a function on N real ranks (forked processes) and collects what each returns.

Each rank gets the caller's environment plus the `env` given, joins a FileStore
rendezvous (no ports to race for), and reports its return value or its exception back
to the parent. The parent enforces a wall-clock limit, kills stragglers, and checks that
nothing was left in /dev/shm.

The ranks are forked from a server process that imported torch and cgx once
(multiprocessing's forkserver): a rank starts in about 0.1 s, where a spawned
interpreter spends 2-4 s importing torch on a 2-core machine. What a fork changes
against a fresh interpreter, and what this module does about it:

- Environment: a forked rank inherits the server's, taken when the server started. The
  rank's is replaced by the caller's os.environ at the call plus `env`, as a spawned
  rank would see it.
- Settings read from the environment at import: TORCH_DISTRIBUTED_DEBUG (torch's debug
  level) and an MPI launcher's ranks (cgx.mpi's adoption) are read again after that.
  Other import-time reads keep the server's value; a test that needs one set must set
  it before the suite starts.
- Thread pools: the server runs no torch operation, so it owns no intra-op (OpenMP)
  pool for a fork to break; each rank makes its own at first use, of the default size.
- Python's random module is reseeded in each rank (CPython does so after a fork).
- A rank ends with os._exit after reporting: atexit handlers do not run, as in any
  forked child; the harness destroys the rank's process groups itself.

tests/test_harness.py checks each of these.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

# Imported once by the server every rank is forked from.
PRELOADED = ["torch", "torch.distributed", "torch.nn.parallel", "cgx", "pytest", "harness"]
SHM_DIR = "/dev/shm"


@dataclass
class RankError:
    """What a rank raised: its type name, message and traceback."""

    type: str
    message: str
    traceback: str


def cgx_shm_entries() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("cgx-")} if os.path.isdir(SHM_DIR) else set()


def init_cgx(rank: int, world_size: int, timeout_s: float = 60.0, pg_options=None):
    """Joins the default "cgx" group of the job (call from inside a rank function)."""
    import torch.distributed as dist

    import cgx  # noqa: F401  (registers the backend)

    dist.init_process_group(
        "cgx",
        init_method=os.environ["CGX_TEST_INIT_METHOD"],
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        pg_options=pg_options,
    )


def _rank_main(rank, fn, world_size, environ, result_dir, args):
    _take_environment(environ)
    try:
        value: Any = fn(rank, world_size, *args)
    except BaseException as e:  # reported to the parent, which decides
        value = RankError(type(e).__name__, str(e), traceback.format_exc())
    finally:
        _shutdown()
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(value, f)


def _take_environment(environ: dict[str, str]) -> None:
    """Makes the forked rank's environment `environ`, and re-reads what torch and cgx
    read from it at import (see the module's docstring)."""
    import torch.distributed as dist

    import cgx.mpi

    os.environ.clear()
    os.environ.update(environ)
    dist.set_debug_level_from_env()
    cgx.mpi.adopt_mpi_launch()


_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


def _shutdown():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    env: dict[str, str] | None = None,
    args: tuple = (),
    timeout_s: float = 180.0,
    expect_exit: set[int] = frozenset(),
) -> list[Any]:
    """fn(rank, world_size, *args) on each rank, in the environment `env` adds to the
    caller's and the defaults (CGX_COMPRESSION_AUTO=0); returns the per-rank results in rank
    order (a RankError for a rank that raised, None for a rank in `expect_exit` that
    exited without reporting). Raises AssertionError on a hang or an unexpected death."""
    shm_before = cgx_shm_entries()
    with tempfile.TemporaryDirectory(prefix="cgx-test-") as tmp:
        # CGX_COMPRESSION_AUTO off unless a test asks: its choices follow timings, and
        # tests compare runs bit for bit (tests/test_auto.py turns it on).
        environ = {**os.environ, "CGX_TEST_INIT_METHOD": f"file://{tmp}/store", "CGX_COMPRESSION_AUTO": "0",
                   **(env or {})}
        processes = [_forkserver().Process(target=_rank_main, args=(rank, fn, world_size, environ, tmp, args))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in processes):
            for p in processes:
                p.kill()
                p.join()
            raise AssertionError(f"ranks still running after {timeout_s} s (hang?)")
        results = []
        for rank, process in enumerate(processes):
            path = os.path.join(tmp, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            elif rank in expect_exit:
                results.append(None)
            else:
                raise AssertionError(f"rank {rank} died with exit code {process.exitcode}")
    leaked = cgx_shm_entries() - shm_before
    if leaked:
        errors = [f"rank {i}: {r.type}: {r.message}" for i, r in enumerate(results)
                  if isinstance(r, RankError)]
        raise AssertionError(f"left in /dev/shm: {sorted(leaked)}; rank errors: {errors}")
    return results


def values(results: list[Any]) -> list[Any]:
    """The results, failing with the rank's traceback if any rank raised."""
    for rank, r in enumerate(results):
        if isinstance(r, RankError):
            raise AssertionError(f"rank {rank} raised {r.type}: {r.message}\n{r.traceback}")
    return results
