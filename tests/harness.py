"""Runs a function on N real ranks (forked processes) and collects what each returns.

Each rank gets the caller's environment plus the `env` given, joins a FileStore
rendezvous (no ports to race for), and reports its return value or its exception back
to the parent. The parent enforces a wall-clock limit, kills stragglers, and checks that
nothing was left in /dev/shm.

The ranks are forked from a server process that imported torch and cgx once
(multiprocessing's forkserver): a rank starts in about 0.02 s, where a spawned
interpreter spends 2-4 s importing torch on a 2-core machine. What a fork changes
against a fresh interpreter, and what this module does about it:

- Environment: a forked rank inherits the server's, taken when the server started. The
  rank's is replaced by the caller's os.environ at the call plus `env`, as a spawned
  rank would see it.
- Settings read from the environment at import: TORCH_DISTRIBUTED_DEBUG (torch's debug
  level) and an MPI launcher's ranks (cgx.mpi's adoption) are read again after that.
  Where the rank's environment gives another value than the server had to a variable in
  READ_AT_IMPORT (thread counts, the hash seed, ...), the call's ranks are spawned
  instead, as `spawn=True` asks.
- Random state: torch's default generator is seeded anew in each rank (numpy's too,
  where the server loaded it), as in a fresh interpreter; CPython reseeds the random
  module after a fork itself. The
  str hash seed cannot change after start: every forked rank of a session has the
  server's. A test whose property needs ranks that iterate sets of strings in different
  orders passes `spawn=True`.
- Thread pools: the server runs no torch operation; OpenBLAS stops its threads before a
  fork. Each rank makes its own pools at first use, of the size OMP_NUM_THREADS gives
  (the suite's tests/conftest.py sets 1 where the caller did not choose).
- Output: a rank's stdout and stderr (file descriptors 1 and 2) go to files that the
  caller copies to its own sys.stdout and sys.stderr when the ranks end, so that pytest
  shows them with the test that ran them (a fork would otherwise write to wherever the
  server's descriptors pointed when it started).
- A hang: the ranks still running at the limit write every thread's Python stack
  (faulthandler, on SIGUSR1) before they are killed; the AssertionError shows those
  stacks, and what the ranks that did return raised.
- Exit: a forked rank ends with os._exit, so after reporting it runs the atexit handlers
  itself (a handler that hangs is caught by the limit, as at a spawned rank's exit);
  Python's finalisation and C++ static destructors do not run.

tests/test_harness.py checks each of these.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

# Imported once by the server every rank is forked from.
PRELOADED = ["torch", "torch.distributed", "torch.nn.parallel", "cgx", "cgx.fsdp", "pytest", "harness"]
# Read when the interpreter starts or torch loads, so a forked rank keeps the server's.
READ_AT_IMPORT = ("PYTHONHASHSEED", "PYTHONWARNINGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "OPENBLAS_NUM_THREADS", "TORCH_LOGS", "TORCH_SHOW_CPP_STACKTRACES")
SHM_DIR = "/dev/shm"


@dataclass
class RankError:
    """What a rank raised: its type name, message and traceback."""

    type: str
    message: str
    traceback: str


# The suite's tag in the names of the segments its ranks create (CGX_SHM_NAME_TAG, set by
# tests/conftest.py in each pytest process and inherited by every process it starts: forked
# and spawned ranks, worker scripts, mpirun's and torchrun's ranks), so that the leak checks
# see only this run's segments, not those of another suite running on the machine meanwhile.
SHM_NAME_TAG = os.environ.get("CGX_SHM_NAME_TAG", "")


def process_gone(pid: int) -> bool:
    """Whether process `pid` has exited (gone from /proc, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return True


def cgx_shm_entries() -> set[str]:
    prefix = f"cgx-{SHM_NAME_TAG}-" if SHM_NAME_TAG else "cgx-"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)} if os.path.isdir(SHM_DIR) else set()


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


def _rank_main(rank, fn, world_size, environ, result_dir, args, forked):
    if forked:
        _become_fresh(environ, os.path.join(result_dir, str(rank)))
    global _stacks
    _stacks = open(os.path.join(result_dir, f"{rank}.stacks"), "w")  # noqa: SIM115  (the rank's lifetime)
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    try:
        value: Any = fn(rank, world_size, *args)
    except BaseException as e:  # reported to the parent, which decides
        value = RankError(type(e).__name__, str(e), traceback.format_exc())
    finally:
        _shutdown()
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(value, f)
    if forked:  # what a spawned rank's exit would run; the limit still applies
        gc.collect()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _become_fresh(environ: dict[str, str], output: str) -> None:
    """Makes a forked rank what a fresh interpreter would be where it can (see the
    module's docstring): its environment, what torch and cgx read from it at import, its
    random state, and its output going to `output`.stdout / .stderr."""
    import torch
    import torch.distributed as dist

    import cgx.mpi

    for fd, stream in ((1, "stdout"), (2, "stderr")):
        target = os.open(f"{output}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(environ)
    dist.set_debug_level_from_env()
    cgx.mpi.adopt_mpi_launch()
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


_context = None
_server_environ: dict[str, str] = {}
_stacks = None  # in a rank: where it writes its threads' stacks on SIGUSR1 (a hang)


def _forkserver():
    """The forkserver context; the server starts at the first rank, with the caller's
    environment of that moment, kept to compare later calls' against."""
    global _context, _server_environ
    if _context is None:
        from multiprocessing import forkserver

        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
        forkserver.ensure_running()
        _server_environ = dict(os.environ)
    return _context


@contextlib.contextmanager
def _environment(environ: dict[str, str]):
    """os.environ is `environ` inside (a spawned child takes its parent's at start)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _replay_output(result_dir: str, world_size: int) -> None:
    """Copies each forked rank's stdout and stderr to the caller's, rank by rank."""
    for rank in range(world_size):
        for stream, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            path = os.path.join(result_dir, f"{rank}.{stream}")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text = f.read()
                if text:
                    out.write(text)
                    out.flush()


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
    spawn: bool = False,
) -> list[Any]:
    """fn(rank, world_size, *args) on each rank, in the environment `env` adds to the
    caller's and the defaults (CGX_COMPRESSION_AUTO=0); returns the per-rank results in rank
    order (a RankError for a rank that raised, None for a rank in `expect_exit` that
    exited without reporting). Raises AssertionError on a hang or an unexpected death.
    The ranks are forked from the server, or spawned (fresh interpreters, 2-4 s each) with
    `spawn` or where `env` or the caller's environment changes a READ_AT_IMPORT
    variable."""
    shm_before = cgx_shm_entries()
    with tempfile.TemporaryDirectory(prefix="cgx-test-") as tmp:
        # CGX_COMPRESSION_AUTO off unless a test asks: its choices follow timings, and
        # tests compare runs bit for bit (tests/test_auto.py turns it on).
        environ = {**os.environ, "CGX_TEST_INIT_METHOD": f"file://{tmp}/store", "CGX_COMPRESSION_AUTO": "0",
                   **(env or {})}
        context = None if spawn else _forkserver()
        forked = context is not None and all(environ.get(v) == _server_environ.get(v) for v in READ_AT_IMPORT)
        context = context if forked else mp.get_context("spawn")
        processes = [context.Process(target=_rank_main, args=(rank, fn, world_size, environ, tmp, args, forked))
                     for rank in range(world_size)]
        # A spawned rank takes the environment as it starts (and reads it at import).
        with contextlib.nullcontext() if forked else _environment(environ):
            for process in processes:
                process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        running = [rank for rank, p in enumerate(processes) if p.is_alive()]
        hung = bool(running)
        for rank in running:  # each writes its stacks (faulthandler's C handler, even in a blocked call)
            os.kill(processes[rank].pid, signal.SIGUSR1)
        _wait_for_the_stacks(tmp, running)
        for p in processes:
            if hung:
                p.kill()
            p.join()
        if forked:
            _replay_output(tmp, world_size)
        if hung:
            # What the ranks that did return raised: often why the others waited on.
            raised = [f"rank {rank} raised {r.type}: {r.message}\n{r.traceback}"
                      for rank, r in enumerate(_reported(tmp, world_size)) if isinstance(r, RankError)]
            stacks = [f"rank {rank}'s threads at the limit:\n{_read(os.path.join(tmp, f'{rank}.stacks'))}"
                      for rank in running]
            raise AssertionError("\n".join([f"ranks {running} still running after {timeout_s} s (hang?)", *raised,
                                            *stacks]))
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


def _wait_for_the_stacks(result_dir: str, ranks: list[int]) -> None:
    """Until each of `ranks` has written its stacks (diagnostics of a hang: at most 10 s,
    so a rank that cannot run its handler does not hold the report)."""
    deadline = time.monotonic() + 10.0
    paths = [os.path.join(result_dir, f"{rank}.stacks") for rank in ranks]
    while time.monotonic() < deadline and not all(os.path.exists(p) and os.path.getsize(p) for p in paths):
        time.sleep(0.05)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read() or "(nothing written)"
    except FileNotFoundError:
        return "(no file: the rank had not started)"


def _reported(result_dir: str, world_size: int) -> list[Any]:
    """Each rank's reported result (its return value or RankError), None where it did not report."""
    reported = []
    for rank in range(world_size):
        path = os.path.join(result_dir, f"{rank}.pkl")
        try:
            with open(path, "rb") as f:
                reported.append(pickle.load(f))
        except (FileNotFoundError, EOFError, pickle.UnpicklingError):  # none, or cut short by the kill
            reported.append(None)
    return reported


def values(results: list[Any]) -> list[Any]:
    """The results, failing with the rank's traceback if any rank raised."""
    for rank, r in enumerate(results):
        if isinstance(r, RankError):
            raise AssertionError(f"rank {rank} raised {r.type}: {r.message}\n{r.traceback}")
    return results


def load_everyones_state(state_dict, load_state_dict) -> dict[int, str]:
    """In a rank: gathers every rank's ``state_dict()`` and tries to load each here;
    saver's rank -> "loaded", or the ValueError's message."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state_dict())
    outcome = {}
    for saver, state in enumerate(everyone):
        try:
            load_state_dict(state)
            outcome[saver] = "loaded"
        except ValueError as e:
            outcome[saver] = str(e)
    return outcome
