"""What the ``stats()`` of the four front-ends return, and the names they used before.

``cgx.stats(group)``, ``CGXState.stats()``, ``QSDP.stats()`` and ``DiLoCo.stats()``
share one vocabulary, each key with one meaning wherever it appears (docs/stats.md):
``bytes_sent`` and ``uncompressed_bytes`` count what the collectives put on the wire
(the backend's counters), ``payload_bytes`` and ``uncompressed_payload_bytes`` what a
front-end handed to them. Names from before (``bytes_uncompressed``, ``peak_bytes``,
``compression_stats()``, ...) still work for one release, with a DeprecationWarning.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any, Mapping

__all__ = ["RENAMED", "Stats", "count_exact", "no_exact", "warn_renamed"]

# The front-ends' stats() and state keys renamed when they took one vocabulary (old -> new;
# docs/stats.md): the one map, read by every front-end and its checkpoints' loading.
RENAMED = {"bytes_sent": "payload_bytes", "bytes_uncompressed": "uncompressed_payload_bytes",
           "peak_bytes": "peak_payload_bytes"}


def no_exact() -> dict[str, Any]:
    """The counts of calls that went the exact way before any did (docs/stats.md):
    exact_calls, exact_bytes and exact_why (reason -> {"calls", "bytes"})."""
    return {"exact_calls": 0, "exact_bytes": 0, "exact_why": {}}


def count_exact(counts: dict[str, Any], reason: str, nbytes: int) -> None:
    """Counts a call of `nbytes` that went the exact way for `reason` into `counts`
    (no_exact()'s keys)."""
    counts["exact_calls"] += 1
    counts["exact_bytes"] += nbytes
    why = counts["exact_why"].setdefault(reason, {"calls": 0, "bytes": 0})
    why["calls"] += 1
    why["bytes"] += nbytes


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """The DeprecationWarning of a name kept for one release (`stacklevel` 3: the caller
    of the function that calls this)."""
    warnings.warn(f"cgx: {old} is deprecated, use {new} (the old name goes in the next release; "
                  f"docs/stats.md)", DeprecationWarning, stacklevel=stacklevel)


class Stats(dict):
    """A ``stats()`` result: a plain dict of the current keys, where a key renamed since
    (RENAMED: old -> new, those whose new key it holds) still reads, warning, as its new
    key's value (indexing,
    ``get``, ``in``; iteration, ``keys()`` and copies list the current keys only). It
    pickles as an OrderedDict of the current keys, so a checkpoint holding it loads with
    ``torch.load(..., weights_only=True)``."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.renamed = {old: new for old, new in RENAMED.items() if new in values}

    def __missing__(self, key: str) -> Any:
        if key not in self.renamed:
            raise KeyError(key)
        return self._renamed_value(key, stacklevel=4)  # the caller of s[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.renamed and not super().__contains__(key):
            return self._renamed_value(key, stacklevel=4)  # the caller of get()
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if super().__contains__(key):
            return True
        if key in self.renamed:
            warn_renamed(f"stats()[{key!r}]", f"stats()[{self.renamed[key]!r}]", stacklevel=3)
            return True
        return False

    def __reduce__(self):
        return (collections.OrderedDict, (), None, None, iter(self.items()))

    def _renamed_value(self, key: str, stacklevel: int) -> Any:
        warn_renamed(f"stats()[{key!r}]", f"stats()[{self.renamed[key]!r}]", stacklevel=stacklevel)
        return self[self.renamed[key]]
