"""The next round, formed in the background while the current one trains on
(Membership.prepare_next_round): torch's rendezvous, the admission and the round's
backend on a thread of their own, which the members take at a sync of theirs.

States: forming (the thread runs) -> formed (a round and its backend) or failed (the
thread's error) -> taken (Membership.next_round). Two more moves: formed again, where
torch's rendezvous formed the round without a member of the current one (it waits for
the round after: the members drop this one and form again, with it); and cancelled
(Membership.close), which makes the thread's waits give up as at their deadlines: torch's
join sees its deadline passed (and takes this node out of the forming round), the
admission's and the backend's waits give up at their next poll. A cancelled forming ends
within one poll of torch's rendezvous (a second) or of a store wait (milliseconds)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable

import torch.distributed as dist

from cgx import _C
from cgx.elastic.rounds import Members
from cgx.errors import MembershipError, PeerError

_log = logging.getLogger("cgx.elastic")

Formed = tuple[Members, _C.ProcessGroupCGX]


class NextRound:
    """One forming of the next round. `form()` forms torch's round and admits it (see
    Membership), `connect(members)` makes its backend; both raise PeerError where a member
    is lost meanwhile. `run_id` names the run in logs."""

    def __init__(self, form: Callable[[], Members], connect: Callable[[Members], _C.ProcessGroupCGX],
                 run_id: str) -> None:
        self._form, self._connect, self._run_id = form, connect, run_id
        self._lock = threading.Lock()  # the result against form_again
        self._cancelled = threading.Event()
        self.failed_at: float | None = None  # when the current round failed while this one forms
        # The nodes of members that torch's rendezvous left out of this round as it
        # formed: a round without them is formed again.
        self._left_out: set[str] = set()
        self._last_formed = -1  # the last round of torch's rendezvous this forming took part in

    def start(self) -> None:
        """Starts forming (once the member holds this object: the thread's waits ask it)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(self._formed())
            except BaseException as e:  # noqa: BLE001  (next_round() raises it, or forms the round itself)
                future.set_exception(e)
        self._future = future
        self._thread = threading.Thread(target=run, name="cgx-next-round", daemon=True)
        self._thread.start()

    def _formed(self) -> Formed:
        while True:
            members = self._form()
            self._last_formed = members.torch_round
            try:
                backend = self._connect(members)
            except PeerError:
                if self._lacks_the_left_out(members) and not self._cancelled.is_set():
                    continue  # the others left it as this one connected
                raise
            with self._lock:
                if not self._lacks_the_left_out(members) or self._cancelled.is_set():
                    return members, backend
            backend.shutdown()

    def cancelled(self) -> bool:
        """Whether the calling thread is this forming's and it was cancelled: its waits
        then give up (the handler's heartbeats and the member's own calls go on)."""
        return self._cancelled.is_set() and threading.current_thread() is self._thread

    @property
    def done(self) -> bool:
        return self._future.done()

    def last_formed(self) -> int:
        return self._last_formed

    def form_again(self, nodes: set[str]) -> bool:
        """Drops the round formed (or forming) where it lacks a member of `nodes` (each
        left out of it), and forms it again; where forming it failed, forms it again too.
        Returns whether it forms again. Once the current round has failed, a round
        without them is kept: they may have died with it."""
        with self._lock:
            self._left_out |= nodes
            if not self._future.done():
                return False  # the thread drops a round without them as it forms it
            failed = self._future.exception()
            if isinstance(failed, MembershipError):
                return False  # next_round raises it
            # A forming that failed (the others left the round as this one connected)
            # forms again too, with them.
            if failed is None and not self._lacks_the_left_out(self._future.result()[0]):
                return False
            backend = None if failed is not None else self._future.result()[1]
        if backend is not None:
            backend.shutdown()
        self.start()
        return True

    def take(self) -> Formed | None:
        """The round formed (waited for), or None where forming it failed (logged: the
        member forms one itself). MembershipError where the run cannot form rounds."""
        try:
            return self._future.result()
        except MembershipError:
            raise
        except (dist.DistError, RuntimeError) as e:  # a member lost as it formed
            _log.warning("cgx.elastic: run %r: forming the next round beside this one failed (%s: %s); it is formed "
                         "again", self._run_id, type(e).__name__, e)
            return None

    def cancel(self) -> None:
        """Ends the forming (close()): its waits give up, and the round, where one formed
        before they did, has its backend shut down. Returns once the thread has ended."""
        self._cancelled.set()
        self._thread.join()
        try:
            formed = self._future.result()
        except BaseException:  # noqa: BLE001  (the forming gave up, as asked)
            return
        formed[1].shutdown()

    def _lacks_the_left_out(self, members: Members) -> bool:
        return self.failed_at is None and not self._left_out <= set(members.nodes)
