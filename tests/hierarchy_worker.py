"""One rank of the emulated 2 hosts x 2 ranks job of tests/test_network.py (started by
benchmarks/launch.py with torch's env:// variables, CGX_HOSTNAME naming its host).

Runs the same compressed allreduce on a hierarchical group (hosts from CGX_HOSTNAME) and
on a single-host group (every rank told it shares one host: shared memory, which the
namespaces share), counting the bytes this host puts on its link around each. Rank 0
writes, for every rank, the error of each result against the exact sum, the largest
difference between the two results, a digest of each result (bit-identity) and the
byte counts to the JSON path in argv[1].
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import cgx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from netemu import link_counters  # noqa: E402

N = 4 << 20  # tests/test_network.py: N_HIERARCHY (4 pipelined pieces)


def inputs(world):
    return [torch.randn(N, generator=torch.Generator().manual_seed(r)) * (r + 1)
            for r in range(world)]


def measured_allreduce(group, x):
    """(result, bytes this host sent on its link, TCP segments it retransmitted, cgx's
    count of bytes to other hosts)."""
    t = x.clone()
    dist.barrier()
    (wire, resent), cross = link_counters(), cgx.stats(group)["cross_host_bytes"]
    dist.all_reduce(t, group=group)
    dist.barrier()  # every peer holds what this host sent
    wire_after, resent_after = link_counters()
    return t, wire_after - wire, resent_after - resent, cgx.stats(group)["cross_host_bytes"] - cross


def main(out_path):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    env = cgx.from_env()
    config = dataclasses.replace(env, bits=4, bucket_size=512, scheme="maxmin")  # the bound is maxmin's
    hierarchical = dist.new_group(backend="cgx", pg_options=config)
    one_host = dist.new_group(backend="cgx",
                              pg_options=dataclasses.replace(config, hostname="one-host"))
    xs = inputs(world)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    x = xs[rank]
    results = {}
    report = {"hierarchical": cgx.get_backend(hierarchical).hierarchical,
              "num_hosts": cgx.get_backend(hierarchical).num_hosts,
              "local_rank": int(os.environ["LOCAL_RANK"])}
    for name, group in (("hierarchical", hierarchical), ("one_host", one_host)):
        t, wire, resent, cross = measured_allreduce(group, x)
        results[name] = t
        report[name + "_error"] = float((t.double() - exact).abs().max())
        report[name + "_digest"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
        report[name + "_wire"] = wire
        report[name + "_resent"] = resent
        report[name + "_cross"] = cross
    report["difference"] = float((results["hierarchical"] - results["one_host"]).abs().max())
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
