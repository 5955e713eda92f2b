"""Where the benchmarks write their results unless told otherwise: benchmarks/results/,
which git ignores (figures meant for the docs are written there with --json / --out)."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_output(name: str) -> str:
    """The path of `name` under benchmarks/results/ (created if missing)."""
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, name)


def parent_made(path: str) -> str:
    """`path`, its folder created if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_progress(path: str, step: int) -> None:
    """Tells a benchmark's driver this process's step (a file replaced whole, so a reader
    never sees half of it)."""
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


def read_progress(path: str) -> int:
    """The step write_progress() last wrote to `path` (0 before the first)."""
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0
