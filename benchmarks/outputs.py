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
