"""matplotlib for the benchmarks' pictures, or a one-line note where it is missing.

The printed tables and the JSON are a benchmark's results; the picture is extra, so a
machine without matplotlib (``pip install ".[bench]"`` brings it) still gets the rest.
"""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (after saying so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print('no picture: matplotlib is not installed (pip install ".[bench]")')
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
