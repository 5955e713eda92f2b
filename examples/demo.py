"""cgx demo: 4 local ranks, a compressed allreduce, a few DDP steps, a few DiLoCo steps.

    python examples/demo.py [--world-size 4] [--bits 4] [--device cuda]

Prints, for rank 0, the bytes cgx put on the wire against what the same algorithm
sends uncompressed, and the error against the exact sum.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world_size: int, bits: int, device_type: str, store_path: str) -> None:
    os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = str(bits)
    import cgx  # registers backend "cgx"

    device = torch.device("cpu")
    if device_type == "cuda":  # ranks share the GPUs there are, round robin
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)  # before init: cgx reads each rank's GPU there

    # One thread a rank, before init: the ranks share this machine's CPUs (cgx warns
    # at init where they would oversubscribe it).
    torch.set_num_threads(1)
    dist.init_process_group("cgx", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))

    # 1. One compressed allreduce of 10M float32 values.
    inputs = [torch.randn(10_000_000, generator=torch.Generator().manual_seed(r))
              for r in range(world_size)]
    t = inputs[rank].to(device, copy=True)
    dist.all_reduce(t)
    exact = torch.stack(inputs).sum(0)
    err = (t.cpu() - exact).abs()
    allreduce_stats = cgx.stats()

    # 2. A few DDP steps of a small MLP; gradients go through the same compressed path.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    w_true = torch.randn(256, 10, generator=torch.Generator().manual_seed(42))
    losses = []
    for _ in range(20):
        x = torch.randn(64, 256, generator=g)
        y = (x @ w_true).argmax(1)
        loss = torch.nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    total = cgx.stats()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(replicas, params)
    identical = all(torch.equal(replicas[0], r) for r in replicas)

    # 3. Streaming DiLoCo: each rank trains alone, fragments sync every 8 steps, 4-bit.
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco_losses = []
    with cgx.DiLoCo(model, opt, sync_every=8, fragments=2, bits=4, overlap=1) as diloco:
        for _ in range(24):
            x = torch.randn(64, 256, generator=g)
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), (x @ w_true).argmax(1).to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()  # DiLoCo's hook runs here
            diloco_losses.append(loss.item())
    outer = torch.cat([w.reshape(-1) for w in diloco.state_dict()["global_weights"].values()])
    outers = [torch.empty_like(outer) for _ in range(world_size)]
    dist.all_gather(outers, outer)
    outer_identical = all(torch.equal(outers[0], o) for o in outers)
    diloco_stats = diloco.stats()
    fp32_ddp = 24 * sum(p.numel() * 4 for p in model.parameters())

    if rank == 0:
        def ratio(s):
            return s["uncompressed_bytes"] / max(1, s["bytes_sent"])

        # The group's scheme (hadamard by default) where it takes these bits, else maxmin.
        scheme = cgx.layers.fitted(bits, 512, cgx.get_backend().settings.scheme.name).scheme
        print(f"cgx demo: {world_size} ranks, {bits}-bit quantization ({scheme}), bucket 512, SRA over "
              f"shared memory, {device_type} tensors")
        print(f"allreduce of 10M float32: sent {allreduce_stats['bytes_sent'] / 2**20:.1f} MiB "
              f"vs {allreduce_stats['uncompressed_bytes'] / 2**20:.1f} MiB uncompressed "
              f"({ratio(allreduce_stats):.2f}x fewer bytes)")
        print(f"  error vs exact sum: max {err.max():.4f}, mean {err.mean():.4f} "
              f"(values of magnitude ~{exact.abs().mean():.2f})")
        ddp_sent = total["bytes_sent"] - allreduce_stats["bytes_sent"]
        ddp_raw = total["uncompressed_bytes"] - allreduce_stats["uncompressed_bytes"]
        print(f"DDP, 20 steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; buckets sent "
              f"{ddp_sent / 2**20:.2f} MiB vs {ddp_raw / 2**20:.2f} MiB uncompressed "
              f"({ddp_raw / max(1, ddp_sent):.2f}x); replicas identical: {identical}")
        print(f"DiLoCo, 24 steps, 2 fragments every 8 steps: loss {diloco_losses[0]:.3f} -> "
              f"{diloco_losses[-1]:.3f}; {diloco_stats['outer_syncs']} syncs sent "
              f"{diloco_stats['payload_bytes'] / 2**20:.2f} MiB vs {fp32_ddp / 2**20:.2f} MiB for float32 DDP "
              f"({fp32_ddp / diloco_stats['payload_bytes']:.0f}x); global weights identical: {outer_identical}")
        # CGX_COMPRESSION_AUTO (on by default) sends a call exactly where that timed faster.
        ddp_buckets = total["calls"] - allreduce_stats["calls"]
        ddp_exact = total["exact_calls"] - allreduce_stats["exact_calls"]
        if ddp_exact or diloco_stats["exact_calls"]:
            print(f"sent exactly: {ddp_exact} of {ddp_buckets} DDP buckets, {diloco_stats['exact_calls']} of "
                  f"{diloco_stats['outer_syncs']} DiLoCo syncs, by CGX_COMPRESSION_AUTO: the exact way timed "
                  f"faster here (stats()['exact_why'], docs/stats.md)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the tensors and the model are (cuda: a CUDA build of cgx)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args.world_size, args.bits, args.device, os.path.join(tmp, "store")),
                 nprocs=args.world_size)


if __name__ == "__main__":
    main()
