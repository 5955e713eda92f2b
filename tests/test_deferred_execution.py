"""The algorithms keep the executor contract (csrc/compression/executor.h) that the CUDA
path relies on: with CGX_DEBUG_DEFERRED_EXECUTION the CPU codec runs like a GPU stream
(work queued until sync(), compressed bytes garbage until then), and every result must
be the one the immediate codec gives, bit for bit. A missing sync() before an exchange
sends garbage; one missing before another thread or phase reads the values reads stale
ones. This is how CI checks the CUDA path's ordering without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cgx
from harness import init_cgx, run_ranks, values


def _immediate_and_deferred(rank, world, cases):
    init_cgx(rank, world)
    out = []
    for case in cases:
        results = []
        for deferred in (False, True):
            config = cgx.Config(
                bits=4,
                minimal_size=0,
                inner_reduction=case["algorithm"],
                cross_reduction=case["algorithm"],
                intra_broadcast=case.get("leader", False),
                hostname=f"host{rank % case['hosts']}" if "hosts" in case else None,
                deferred_execution=deferred,
            )
            group = dist.new_group(backend="cgx", pg_options=config)
            g = torch.Generator().manual_seed(rank + case["n"])
            t = torch.randn(case["n"], generator=g) * (rank + 1)
            residual = None
            if "layout" in case:
                # Raw and quantized segments of a DDP bucket's plan; error feedback's
                # residual where the case asks for it.
                residual = torch.ones(case["n"]) * 0.25 if case.get("residual") else None
                cgx.get_backend(group).allreduce_layout(t, case["layout"], residual=residual).wait()
            else:
                dist.all_reduce(t, group=group)
            results.append(t if residual is None else torch.cat([t, residual]))
            dist.destroy_process_group(group)
        out.append((case, torch.equal(results[0], results[1])))
    return out


def check(results):
    for rank, per_case in enumerate(values(results)):
        for case, same in per_case:
            assert same, f"rank {rank}: deferred execution changed the result: {case}"


@pytest.mark.parametrize("world", [2, 3])
def test_flat_algorithms_keep_the_executor_contract(world):
    n = 100_003
    cases = [{"algorithm": alg, "n": n} for alg in ("SRA", "Ring")] + [
        {"algorithm": alg, "n": n, "residual": residual,
         "layout": [(0, 1000, 32, 1), (1000, 50_000, 2, 256), (51_000, n - 51_000, 8, 512)]}
        for alg, residual in (("SRA", False), ("SRA", True), ("Ring", True))
    ]
    check(run_ranks(_immediate_and_deferred, world, args=(cases,)))


def test_hierarchical_forms_keep_the_executor_contract():
    # 2 hosts x 2 ranks, pipelined (the cross phases on a second thread and executor);
    # then the leader form.
    n = 5_000_003
    cases = [{"algorithm": alg, "n": n, "hosts": 2} for alg in ("SRA", "Ring")]
    cases.append({"algorithm": "SRA", "n": n, "hosts": 2, "leader": True})
    # With error feedback's residual, the pipelined two threads writing it.
    cases.append({"algorithm": "SRA", "n": n, "hosts": 2, "residual": True,
                  "layout": [(0, 1000, 32, 1), (1000, n - 1000, 4, 512)]})
    check(run_ranks(_immediate_and_deferred, 4, args=(cases,), timeout_s=300))


def test_lone_rank_on_a_host_keeps_the_executor_contract():
    # Hosts {0, 2} and {1}: rank 1's cross phase starts at once, on its second executor.
    check(run_ranks(_immediate_and_deferred, 3,
                    args=([{"algorithm": "SRA", "n": 5_000_003, "hosts": 2}],), timeout_s=300))
