"""DiLoCo's turns: at each inner step, which syncs in flight are applied and which sync
starts, by inner steps (fragment p at the steps t with t % sync_every == its offset) or
by time (the numbered syncs the clock says are due, clock.py); and a sync's start and
finish. DiLoCo takes them as a base class: they work on its state (its step, fragments,
replicas, syncs in flight, recovery), which diloco.py sets up."""

from __future__ import annotations

from cgx.diloco.fragments import Fragment
from cgx.diloco.syncs import Sync, Weight, start_sync


class Turns:
    """The schedule's side of cgx.DiLoCo (its base class)."""

    def _syncs_of_this_step(self) -> list[list[int]]:
        """Finishes the syncs due at this step and starts the one whose turn it is. Run
        again after the replicas re-formed (Recovery.run), it does what is left: an
        applied sync has left the in-flight list, and a fragment's sync starts once.
        Returns what the checked syncs' rows say of joiners (Recovery.admit)."""
        if self._clock is not None:
            return self._syncs_by_time()
        joining = [self._finish(sync) for sync in [s for s in self._in_flight if s.due == self.step]]
        for fragment in self._fragments.all:
            if self.step % self.sync_every == fragment.offset and fragment.last_start != self.step:
                # A whole interval: the steps since the fragment's last sync started (alike on every replica).
                joining += self._start(fragment, self.step, self.step - max(fragment.last_start, 0))
        return joining

    def _syncs_by_time(self) -> list[list[int]]:
        """The time schedule's turn: applies the syncs in flight that completed (from
        `overlap` steps after their start), then starts the next sync if it is due, one
        a step at most (syncs_started counts up by one; a replica that was stopped
        catches up over its next steps), applying the fragment's last one first. Returns
        what sync n - P's rows said of joiners as sync n starts: replicas apply syncs at
        different steps, but all start n at the same place among their collectives."""
        for sync in [s for s in self._in_flight if self.step >= s.due and (self.overlap == 0 or s.ready())]:
            self._keep_rows(sync.agreement.step, self._finish(sync))
        if self._clock.due() <= self.syncs_started or self._started_at == self.step:  # (a step run again)
            return []
        self._started_at, number, count = self.step, self.syncs_started + 1, len(self._fragments)
        fragment = self._fragments[number % count]
        for earlier in [s for s in self._in_flight if s.fragment is fragment]:
            self._keep_rows(earlier.agreement.step, self._finish(earlier))
        for rows in self._start(fragment, number, 1):  # (by time, a whole interval is not a step count)
            self._keep_rows(number, rows)
        rows = self._rows_seen.pop(number - count, None)
        self._rows_seen = {n: r for n, r in self._rows_seen.items() if n > number - count}
        return [] if rows is None else [rows]

    def _keep_rows(self, number: int, rows: list[int]) -> None:
        if rows:
            self._rows_seen[number] = rows

    def _start(self, fragment: Fragment, position: int, unit: int) -> list[list[int]]:
        """Starts the fragment's sync at `position` (the inner step, or by time the sync's
        number), weighing the steps since its interval began here of `unit`; without
        overlap, finishes it too (returning what its rows say of joiners)."""
        elastic = self._recovery is not None
        changed, trained, strangers, state = self._fragments.at_sync_start(fragment, self._replicas.residuals,
                                                                           state=elastic)
        self._weights_changed |= changed  # leaving members take their global weights
        joiners = self._recovery.joining(self._replicas.size) if elastic else 0
        sync = start_sync(fragment, self._replicas, position, self.step + self.overlap, self.error_feedback, trained,
                          strangers, joiners, keep=elastic, state=state,
                          weight=Weight(self.step - fragment.interval_start, unit))
        fragment.interval_start = self.step
        if self._clock is None:  # (by time its step is this replica's own: not in the layout replicas compare)
            fragment.last_start = self.step
        self._in_flight.append(sync)
        self.syncs_started += 1
        return [self._finish(sync)] if self.overlap == 0 else []

    def _finish(self, sync: Sync, follow: bool = True) -> list[int]:
        """Finishes the sync (Sync.finish: its agreement checked, its collective waited
        for, applied); with `follow`, then makes the synced set follow the trained set
        the replicas agreed on. A failed collective or agreement raises and changes
        nothing (on a group its sync is dropped; in an elastic run it stays in flight, to
        be done again). Returns what each replica's row says of joiners (Recovery.joining;
        empty where the agreement was checked before)."""
        if self._recovery is None:
            self._in_flight.remove(sync)
        joiners = sync.finish(self._replicas, self.overlap, self.mix)
        if self._recovery is not None:
            self._in_flight.remove(sync)
        self._weights_changed = True
        if follow:
            self._fragments.follow(sync.agreement.trained, self._replicas)
        return joiners
