"""A replica that is a host's group of ranks (DDP inside), in an elastic DiLoCo run.

Only the group's rank 0, the lead, is a member of the run (it holds the Membership and
does DiLoCo's syncs); the host's other ranks follow it. After every inner step the lead
broadcasts over the host's group a header, its step, the syncs started (a loop may stop
at a count of them, under the time schedule) and what happened, and, where its
local weights changed (a sync applied, the run's state taken), every parameter's
weights: between syncs DDP keeps the host's ranks equal, so this keeps them equal
across syncs too. A lead that fails says so before it raises, so that its followers
raise rather than wait. Where one of the host's ranks dies, torchrun (--max-restarts)
restarts the whole host, which then joins the run as a new replica.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from cgx.agreement import first_difference
from cgx.diloco.tensors import move_by_dtype

UNCHANGED, CHANGED, CLOSED, FAILED, LEFT = range(5)

_log = logging.getLogger("cgx.diloco")


class ReplicaHost:
    """One rank's view of its host's group (`group`, the ranks of one replica)."""

    def __init__(self, group: dist.ProcessGroup, model: torch.nn.Module) -> None:
        if any(hasattr(p, "to_local") for p in model.parameters()):
            raise ValueError("cgx.DiLoCo: replica_group needs every rank of the host to hold the whole model (DDP "
                             "inside); under FSDP2 each rank is a replica of its own shard (group= pairs them)")
        self.group = group
        self.model = model
        self.lead = dist.get_global_rank(group, 0)
        self.is_lead = dist.get_rank(group) == 0
        # Everything travels on the parameters' device: a GPU host's group may be NCCL alone.
        self.device = next(iter(model.parameters()), torch.empty(0)).device

    def agree(self, problem: Exception | None, fields: dict[str, object]) -> None:
        """Every rank of the host raises where one of them could not build DiLoCo
        (`problem`: that rank raises it, the others a ValueError naming it) or where they
        built it otherwise (ValueError naming the first field that differs)."""
        problems: list[str | None] = [None] * self.group.size()
        dist.all_gather_object(problems, None if problem is None else f"{type(problem).__name__}: {problem}",
                               group=self.group)
        if problem is not None:
            raise problem
        for rank, text in enumerate(problems):
            if text is not None:
                raise ValueError(f"cgx.DiLoCo: rank {rank} of replica_group could not build DiLoCo ({text})")
        difference = first_difference(None, fields, all_gather=self._all_gather)
        if difference:
            raise ValueError(f"cgx.DiLoCo: the ranks of replica_group were given different settings: {difference}; "
                             f"every rank of a host builds DiLoCo alike, on the same model")

    def timeout(self) -> datetime.timedelta | None:
        """The host group's timeout: how long a follower waits for its lead (None: unknown)."""
        try:
            return self.group._get_backend(self.device).options._timeout
        except (AttributeError, RuntimeError):
            return None

    def warn_if_it_waits_less(self, needed: datetime.timedelta) -> None:
        """A follower waits for its lead as long as the host group's timeout; a lead can
        spend `needed` (a group timeout finding a replica dead, then a join timeout forming
        the next round). A host group that gives up sooner ends a healthy host."""
        timeout = self.timeout()
        if timeout is not None and timeout < needed:
            _log.warning("cgx.DiLoCo: replica_group's timeout (%s) is shorter than the lead may take to re-form "
                         "the run (group_timeout + join_timeout = %s): the host's other ranks may give up on a "
                         "healthy lead; create the host's group with timeout=%s or more", timeout, needed, needed)

    def check_the_lead(self, step: int, event: int, ending: bool) -> None:
        """A follower, on the lead's word (hear()) after its step (`ending`: after its
        close() or leave(), which this rank's close() or leave() meets): RuntimeError where
        the lead failed or left out of turn, or went on where this rank ended."""
        lead = "this replica's lead rank (rank 0 of replica_group)"
        if event == FAILED or (event == LEFT and not ending):
            raise RuntimeError(f"cgx.DiLoCo: {lead} {'failed: see its error' if event == FAILED else 'left the run'}"
                               f", at inner step {step}")
        if ending and event not in (CLOSED, LEFT):
            raise RuntimeError(f"cgx.DiLoCo: {lead} took inner step {step} where this rank ended: every rank of a "
                               f"host calls close() (or leave()) at the same point")

    def tell(self, step: int, syncs_started: int, event: int) -> None:
        """The lead: its step, syncs started and `event`, with the weights where they changed."""
        self._header(torch.tensor([step, syncs_started, event], dtype=torch.int64, device=self.device))
        if event in (CHANGED, CLOSED):
            self._weights()

    def hear(self) -> tuple[int, int, int]:
        """A follower: the lead's step, syncs started and event (its weights taken where
        they changed)."""
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._header(header)
        step, syncs_started, event = (int(v) for v in header.cpu())
        if event in (CHANGED, CLOSED):
            self._weights()
        return step, syncs_started, event

    def _header(self, header: torch.Tensor) -> None:
        dist.broadcast(header, self.lead, group=self.group)

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        mine = tensor.to(self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.group.size())]
        dist.all_gather(everyone, mine, group=self.group)
        return [t.cpu() for t in everyone]

    def _weights(self) -> None:
        move_by_dtype(list(self.model.parameters()), lambda flat: dist.broadcast(flat, self.lead, group=self.group))
