import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# This pytest process's own tag for the shared-memory segments of everything it starts
# (tests/harness.py), whatever it inherited: a suite started from another one's process,
# or pytest-xdist's workers from their controller, would otherwise share that one's.
os.environ["CGX_SHM_NAME_TAG"] = f"test{os.getpid()}"
# One intra-op thread a process, as torchrun gives its ranks, unless the caller chose: the
# suite's ranks share a few cores, and two ranks of a 2-core machine with a pool of two
# threads each spent a fifth more time (tests/test_fsdp.py and test_hooks.py: 109 -> 86 s).
# Set before torch is imported here, so this process, the ranks forked from its server and
# every process it starts read it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What `python -P` does for the README's pytest, for the interpreters it cannot reach:
# pytest-xdist's workers, and the harness's forkserver, which ignores its parent's
# sys.path (Python 3.11): its path would begin with the current folder, the repository,
# and its preload take the source folder cgx/ instead of the installed package.
os.environ.setdefault("PYTHONSAFEPATH", "1")

from harness import cgx_shm_entries  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no shared-memory segment of ours, no child process."""
    before = cgx_shm_entries()
    yield
    import multiprocessing

    assert cgx_shm_entries() - before == set(), "cgx segments left in /dev/shm"
    assert multiprocessing.active_children() == [], "child processes still running"


# Files that spend most of their time waiting (torch's rendezvous missing heartbeats,
# group timeouts, fresh interpreters) rather than computing. They go first, so that under
# the README's command (pytest-xdist, two workers given one file at a time, in this
# order) one worker waits on them while the other runs the CPU-bound files.
WAITING_FILES = ("test_elastic.py",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in WAITING_FILES)
