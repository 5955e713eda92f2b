"""The time schedule's clock (cgx.DiLoCo with ``sync_every=timedelta``): which syncs are
due on this replica, by its own monotonic clock.

The syncs are numbered 1, 2, ... alike on every replica (sync k is fragment k mod P's).
Sync k is due at ``anchor + (k - first) * interval / P``, where `anchor` is this
replica's time.monotonic() when a collective that every replica was in completed (the
run's start), so the replicas' deadlines differ only by how far apart that completion
was seen: no clock is shared across sites, and a clock set forward or back does not move
a monotonic one. Deadlines are fixed from the anchor, not from when each sync started,
so a replica's lateness (its inner step ends after the deadline) does not add up; a
replica that was stopped finds several syncs due at once and starts them in turn. Which
replica did how much in between is not the clock's business: each sync weighs what every
replica sent by the inner steps behind it (syncs.py)."""

from __future__ import annotations

import datetime
import time


class SyncClock:
    """The deadlines of the numbered syncs on this replica."""

    def __init__(self, interval: datetime.timedelta, fragments: int) -> None:
        self._fragments = fragments
        self._spacing = interval.total_seconds() / fragments
        self._anchor: float | None = None
        self._first = 0  # the number of the sync whose deadline is the anchor

    def anchor(self, started: int, now: float | None = None) -> None:
        """Sync `started` + 1 falls due one spacing (interval / fragments) from `now`
        (default: this moment)."""
        self._anchor = time.monotonic() if now is None else now
        self._first = started

    def retime(self, interval: datetime.timedelta, started: int) -> None:
        """The interval becomes `interval` from sync `started`'s deadline on (a setting
        changed during the run: the next syncs keep their place in the sequence)."""
        deadline = self.deadline(started) if started > self._first else self._anchor
        self._spacing = interval.total_seconds() / self._fragments
        self._anchor, self._first = deadline, started

    @property
    def anchored(self) -> bool:
        """Whether the run's start (or a state taken) has set the deadlines yet."""
        return self._anchor is not None

    @property
    def spacing(self) -> float:
        """Seconds between two syncs' deadlines (interval / fragments)."""
        return self._spacing

    def deadline(self, sync: int) -> float:
        """When sync number `sync` falls due, on this replica's monotonic clock."""
        return self._anchor + (sync - self._first) * self._spacing

    def due(self, now: float | None = None) -> int:
        """The number of the last sync due by `now` (default: this moment)."""
        now = time.monotonic() if now is None else now
        return self._first + max(int((now - self._anchor) // self._spacing), 0)
