"""The errors a cgx collective raises, by what happened.

Each subclasses the error torch.distributed already raises for its kind, so code that
catches ``RuntimeError``, ``torch.distributed.DistBackendError`` or ``DistNetworkError``
keeps working. They arrive from ``work.wait()``, ``dist.all_reduce(...)`` and
``future.wait()`` / ``future.value()``; where torch re-raises an error on a path of its
own (DDP's backward, say) the same failure arrives as torch's base class. Every rank in
the call raises (docs/algorithms.md, "Errors"). Bad arguments, refused on the caller's
thread before anything is sent, raise ``ValueError`` / ``TypeError`` as torch does.

After a PeerError or CollectiveTimeoutError data may be half delivered: the group is
unusable, and every later call on it raises the same type, saying so. After a
CallMismatchError only the call signatures moved and the group stays usable (unless the
ranks had drifted apart by taking different paths earlier).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["PeerError", "CollectiveTimeoutError", "CallMismatchError", "MembershipError"]


class PeerError(dist.DistNetworkError):
    """A peer died or the link to it failed (connection closed, MPI finalizing)."""


class CollectiveTimeoutError(dist.DistBackendError):
    """A wait passed the group's timeout: a peer is dead, stuck or out of step."""


class CallMismatchError(dist.DistBackendError):
    """Ranks were given different calls (sizes, dtypes, plans, settings); the message
    names the first field that differs and the ranks on each side."""


class MembershipError(dist.DistError):
    """An elastic run could not form a round: fewer than its minimum of replicas within
    the wait, or its rendezvous could not be reached (cgx.elastic)."""
