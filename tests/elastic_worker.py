"""One replica of the emulated-hosts elastic DiLoCo run of tests/test_elastic.py (started
in its host's network namespace, CGX_HOSTNAME naming the host).

argv: replica index, rendezvous address, steps, output JSON path. Trains the small model
of tests/test_diloco.py with cgx.DiLoCo over a cgx.elastic.Membership and writes the
digest of its global weights after every inner step, its fragments' sync counts and its
stats. Replica 0 serves the rendezvous store and writes its step and the run's replicas
to <output>.step as it goes (the test cuts a link and restores it from them), and leaves
last.

The run ends at the first step from `steps` on where every replica is back in it after a
re-form (3 replicas, and a round after the first): the same step on every replica, known
from what the run did, not from how fast it went. (A run that ended at a fixed step could
end while the cut replica is still away, which then waits for a round nobody joins.)
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import cgx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_diloco import _model, _train_step  # noqa: E402
from test_elastic import _global_digest, _start_together  # noqa: E402

replica, address, steps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
port = 29400
membership = cgx.elastic.Membership(
    f"{address}:{port}", "link-cut", is_host=replica == 0, min_replicas=2,
    heartbeat=datetime.timedelta(seconds=1), last_call=datetime.timedelta(seconds=1),
    group_timeout=datetime.timedelta(seconds=8))
store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=300))
_start_together(membership, store, "link-cut", replica, 3)  # a first round of all three, however slow their start
model = _model(replica)
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
diloco = cgx.DiLoCo(model, inner, sync_every=4, fragments=2, bits=4, overlap=1, membership=membership)
digests = {}


def everyone_is_back() -> bool:
    stats = diloco.stats()
    return stats["replicas"] == 3 and stats["rounds"] >= 2


while diloco.step < steps or not everyone_is_back():
    _train_step(model, inner, replica, diloco.step)
    digests[diloco.step] = _global_digest(diloco)
    if replica == 0:
        with open(out + ".step.tmp", "w") as f:
            json.dump({"step": diloco.step, "replicas": diloco.stats()["replicas"]}, f)
        os.replace(out + ".step.tmp", out + ".step")
    time.sleep(0.02)  # a step of a real model's length: the run waits for no one between syncs
diloco.close()
digests["end"] = _global_digest(diloco)
with open(out, "w") as f:
    json.dump({"digests": digests, "syncs": [f.syncs for f in diloco._fragments], "stats": dict(diloco.stats()),
               "steps": diloco.step}, f)
if replica == 0:
    store.wait(["link-cut-done/1", "link-cut-done/2"])
else:
    store.set(f"link-cut-done/{replica}", "1")
membership.close()
