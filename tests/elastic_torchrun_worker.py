"""A replica of the torchrun test of tests/test_elastic.py: argv slot, rendezvous port,
output path. Slot 1 runs under torchrun --max-restarts and kills itself (SIGKILL) at inner
step 10 of its first incarnation; torchrun starts it again and it joins the run. Both
end at the first step from 24 on after slot 1 was lost (the same step on both: its
restart joins the round that counts the loss). Each writes the digest of its global
weights at the end and its stats' joined / lost counts."""

import datetime
import hashlib
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cgx  # noqa: E402
from test_diloco import _model, _train_step  # noqa: E402

slot, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# Two replicas or none: the run starts with both (a slot 1 that came late would miss its
# kill at step 10), and slot 0 waits for slot 1's restart rather than train alone.
m = cgx.elastic.Membership(f"127.0.0.1:{port}", "trun", is_host=slot == 0, min_replicas=2,
                           heartbeat=datetime.timedelta(seconds=1))
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
model = _model(slot)
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
d = cgx.DiLoCo(model, inner, sync_every=4, fragments=2, bits=4, overlap=1, membership=m)
while d.step < 24 or (slot == 0 and d.stats()["replicas_lost"] == 0):
    if slot == 1 and incarnation == 0 and d.step == 10:
        os.kill(os.getpid(), signal.SIGKILL)
    _train_step(model, inner, slot, d.step)
d.close()
h = hashlib.blake2b(digest_size=8)
for _, w in sorted(d.state_dict()["global_weights"].items()):
    h.update(w.numpy().tobytes())
with open(f"{out}.{slot}", "w") as f:
    f.write(f"{h.hexdigest()} {d.stats()['replicas_joined']} {d.stats()['replicas_lost']} {incarnation}")
if slot == 0:
    store.wait(["done1"])
else:
    store.set("done1", "1")
m.close()
