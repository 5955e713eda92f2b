import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import cgx_shm_entries  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no shared-memory segment of ours, no child process."""
    before = cgx_shm_entries()
    yield
    import multiprocessing

    assert cgx_shm_entries() - before == set(), "cgx segments left in /dev/shm"
    assert multiprocessing.active_children() == [], "child processes still running"
