"""Runs a function on N real ranks (spawned processes) and collects what each returns.

Each rank gets the environment given, joins a FileStore rendezvous (no ports to race
for), and reports its return value or its exception back to the parent. The parent
enforces a wall-clock limit, kills stragglers, and checks that nothing was left in
/dev/shm.
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


def _rank_main(rank, fn, world_size, env, result_dir, args):
    os.environ.update(env)
    try:
        value: Any = fn(rank, world_size, *args)
    except BaseException as e:  # reported to the parent, which decides
        value = RankError(type(e).__name__, str(e), traceback.format_exc())
    finally:
        _shutdown()
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(value, f)


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
    defaults (CGX_COMPRESSION_AUTO=0); returns the per-rank results in rank
    order (a RankError for a rank that raised, None for a rank in `expect_exit` that
    exited without reporting). Raises AssertionError on a hang or an unexpected death."""
    shm_before = cgx_shm_entries()
    with tempfile.TemporaryDirectory(prefix="cgx-test-") as tmp:
        # CGX_COMPRESSION_AUTO off unless a test asks: its choices follow timings, and
        # tests compare runs bit for bit (tests/test_auto.py turns it on).
        rank_env = {"CGX_TEST_INIT_METHOD": f"file://{tmp}/store", "CGX_COMPRESSION_AUTO": "0",
                    **(env or {})}
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world_size, rank_env, tmp, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise AssertionError(f"ranks still running after {timeout_s} s (hang?)")
            time.sleep(0.05)
        results = []
        for rank, process in enumerate(ctx.processes):
            process.join()
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
