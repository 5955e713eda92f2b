"""A rank of a host's replica (DDP inside, 2 ranks) in the per-host elastic DiLoCo test of
tests/test_elastic.py, started by `torchrun --standalone --nproc-per-node=2
--max-restarts=1` inside its emulated host. argv: host, the run's rendezvous address,
steps, output path prefix. The host's rank 0 leads (holds the Membership); on host 1,
rank 1 kills itself (SIGKILL) at inner step 10 of its first incarnation, and torchrun
restarts the host. Rounds need both hosts: the run starts with both (a host 1 that came
late would miss its kill), and host 0 waits for host 1's restart. The leads end at the
first step from `steps` on after host 1 was lost (the same step on both: the restart
joins the round that counts the loss); each lead tells its host's other rank whether to
go on. Each rank writes a digest of its weights at the end; a lead also its global
weights' and its fragments' sync counts."""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_diloco import _model, _train_step  # noqa: E402

host, address, steps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
port = 29411
rank = int(os.environ["RANK"])
incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# The host's own ranks, on torchrun's store under a prefix of this incarnation: a restart
# must not read the addresses its killed predecessors published.
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(f"host-incarnation-{incarnation}/", store), rank=rank,
                        world_size=int(os.environ["WORLD_SIZE"]))
model = DDP(_model(0))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
membership = None
if rank == 0:
    membership = cgx.elastic.Membership(
        f"{address}:{port}", "per-host", is_host=host == 0, min_replicas=2,
        heartbeat=datetime.timedelta(seconds=1), last_call=datetime.timedelta(seconds=1),
        group_timeout=datetime.timedelta(seconds=8))
diloco = cgx.DiLoCo(model, inner, sync_every=4, fragments=2, bits=4, membership=membership,
                    replica_group=dist.group.WORLD)


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def go_on() -> bool:
    """The lead's verdict, told to the host's other rank."""
    verdict = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        verdict[0] = diloco.step < steps or (host == 0 and diloco.stats()["replicas_lost"] == 0)
    dist.broadcast(verdict, 0)
    return bool(verdict[0])


by_step = {}  # the weights after every inner step: the host's ranks must hold the same
while go_on():
    if host == 1 and rank == 1 and incarnation == 0 and diloco.step == 10:
        os.kill(os.getpid(), signal.SIGKILL)
    _train_step(model, inner, 10 * host + rank, diloco.step)
    by_step[diloco.step] = digest(model.parameters())
diloco.close()
result = {"weights": digest(model.parameters()), "by_step": by_step, "incarnation": incarnation}
if rank == 0:
    state = diloco.state_dict()
    result.update(globals=digest(state["global_weights"][n] for n in sorted(state["global_weights"])),
                  syncs=[f.syncs for f in diloco._fragments], stats=dict(diloco.stats()), steps=diloco.step)
with open(f"{out}.{host}.{rank}", "w") as f:
    json.dump(result, f)
if rank == 0:  # the run's store lives in host 0's lead: it goes last
    store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=120))
    if host == 0:
        store.wait(["per-host-done/1"])
    else:
        store.set("per-host-done/1", "1")
    membership.close()
# Drop what holds the host's Gloo group (DDP, DiLoCo) so that destroy_process_group()
# destroys it, its threads joined, while the interpreter is alive: a Gloo worker thread
# that lets go of its last work's tensors once finalization has begun aborts the process
# (std::terminate in a forced unwind: pytorch/pytorch#190489; seen twice here, in a lead
# and in a restarted follower, after their results were written).
del model, inner, diloco
gc.collect()
dist.destroy_process_group()
