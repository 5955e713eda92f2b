"""Membership of an elastic run: rounds of replicas from torch.distributed.elastic.

The replicas of an elastic run (a rank each, or each host's lead rank) are started on
their own, each naming a rendezvous endpoint and a run id. Who is in the run comes from
torch's own dynamic rendezvous, the handler torchrun uses (the c10d store backend by
default, etcd where one runs): it forms rounds between ``min_replicas`` and
``max_replicas`` members, drops a member whose heartbeats stop, and keeps late arrivals
waiting until the members admit them with a new round. cgx adds one thing per round: a
compressing backend of its own (``ProcessGroupCGX``) on the round's store, which torch
already prefixes per round, so no key of an earlier round (or of a member that died in
it) can pair with this one's.

A round ends when a collective of it fails (a member died or lost its link: the failure
raises on every member still in the call) or when the members decide to admit joiners
(:meth:`Membership.joiners_waiting`); every member then calls :meth:`next_round`. After a
failure, a roll call on the round's store lets the members that answer go on at once,
and tells the rendezvous that the others are gone, rather than wait until it has missed
their heartbeats.

Example (one replica of a run; every replica runs the same)::

    membership = cgx.elastic.Membership("site-a.example:29400", "run-42", min_replicas=2)
    round_ = membership.next_round()            # waits for at least 2 replicas
    work = round_.backend.allreduce([tensor])   # a cgx backend of round_.size members
    ...                                         # where a collective failed:
    round_ = membership.next_round(after_failure=True)
    membership.close()                          # leaves (end_run() first ends the run for all)

This is the membership layer of elastic Streaming DiLoCo: ``cgx.DiLoCo(...,
membership=membership)`` syncs over the current round, re-forms it when a sync fails
(doing that sync again among the survivors) and admits joiners at a sync, giving them
the run's state from a live member (docs/diloco.md, "Elastic runs").
What happens when the rendezvous host itself dies: the c10d store lives in the process
that hosts it, so the run cannot form a new round (the current round's collectives go on,
the next :meth:`next_round` fails); etcd, which replicates its state, does not have this
weakness.
"""

from cgx.elastic.membership import Membership
from cgx.elastic.rounds import Round

__all__ = ["Membership", "Round"]
