"""DiLoCo with replicas of unequal speed: the step schedule (every replica takes
sync_every inner steps between syncs, so the fast ones wait) against the time schedule
(``sync_every=timedelta``: every replica trains for the interval, each outer gradient
weighed by the inner steps behind it), side by side on one task and seed.

A replica is slowed by a factor F by sleeping (F - 1) times its own forward and backward
time after each step (``--speeds 1 2``: replica 1 at half speed). Each pair of runs makes
the same number of syncs: the step schedule's run first (``--sync-every`` steps, in
``--fragments`` fragments, 4-bit outer gradients, overlap 1), then the time schedule's
with the interval the step run took per sync_every steps, so both sync at the same rate
in wall-clock time and end after about as long. Reported per run: rank 0's validation
loss at the end (equal wall clock) and where both runs' replicas had taken as many inner
steps in all (the fewer of the two runs' totals: equal tokens, every replica's batch
being the same size; loss interpolated between rank 0's snapshots, one as each sync
started, evaluated after the run, and the end), the inner steps of each replica, and each
replica's idle share: the time it waited for a sync (``stats()['wait_seconds']``) over
the run's, and the syncs rank 0 sent the exact way (none unless ``--auto``: with
``CGX_COMPRESSION_AUTO`` on, its timings choose exact or compressed per run and move the
loss by about 1% between runs of one seed). ``--repeats R`` runs the time schedule R times
per seed (each against the seed's step run, at the tokens every run reached): its syncs fall
at other inner steps run to run, so one run per seed says little below a percent; the
summary gives the mean of the runs' ratios to the step run and its standard error.

    python -P benchmarks/unequal_replicas.py --task gpt --speeds 1 2 --seeds 0 1 2
    python -P benchmarks/unequal_replicas.py --task shapes --speeds 1 1 2 4 --syncs 48
    python -P benchmarks/unequal_replicas.py --task gpt --speeds 1 1 --seeds 0 1 2 3 4 --repeats 3

Writes <out>/<task>-<speeds>.json (benchmarks/results/unequal unless --out says
otherwise; per seed its step run and a list of its time runs) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here

from outputs import default_output  # noqa: E402
from train import TASKS  # noqa: E402


def run_replica(rank, world, task_name, seed, speeds, schedule, sync_every, fragments, syncs, interval_s,
                init_method, out_path):
    """One replica of one run; rank 0 writes the run's result to `out_path`."""
    import cgx

    torch.set_num_threads(1)
    dist.init_process_group("cgx", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    task = TASKS[task_name]()
    torch.manual_seed(seed)
    model = task.model()
    inner = torch.optim.AdamW(model.parameters(), lr=task.lr)
    every = sync_every if schedule == "step" else datetime.timedelta(seconds=interval_s)
    diloco = cgx.DiLoCo(model, inner, sync_every=every, fragments=fragments, bits=4, overlap=1)
    steps_by_step = syncs * sync_every // fragments  # the step schedule's length: `syncs` syncs
    snapshots, at_sync = [], []  # rank 0's weights as each sync started; (syncs, inner step) then
    start = time.perf_counter()
    step = 0
    while (step < steps_by_step) if schedule == "step" else (diloco.syncs_started < syncs):
        began = time.perf_counter()
        x, y = task.batch_for(rank, step, seed)
        loss = task.loss(model, x, y)
        inner.zero_grad()
        loss.backward()
        time.sleep((speeds[rank] - 1) * (time.perf_counter() - began))
        inner.step()
        step += 1
        if not at_sync or at_sync[-1][0] != diloco.syncs_started:
            at_sync.append((diloco.syncs_started, step))
            if rank == 0:
                snapshots.append((diloco.syncs_started, copy.deepcopy(model.state_dict())))
    seconds = time.perf_counter() - start
    waited = diloco.stats()["wait_seconds"]
    diloco.close()
    exact = diloco.stats()["exact_calls"]
    everyone = [None] * world
    dist.all_gather_object(everyone, {"steps": step, "idle": waited / seconds, "at_sync": at_sync, "exact": exact})
    if rank == 0:
        final = task.evaluate(model)["val_loss"]
        curve = []
        for number, state in snapshots:  # total inner steps of every replica at that sync
            total = sum(next((s for n, s in r["at_sync"] if n >= number), r["steps"]) for r in everyone)
            model.load_state_dict(state)
            curve.append((total, task.evaluate(model)["val_loss"]))
        curve.append((sum(r["steps"] for r in everyone), final))
        with open(out_path, "w") as f:
            json.dump({"schedule": schedule, "seconds": seconds, "val_loss": final, "curve": curve,
                       "steps": [r["steps"] for r in everyone], "idle": [r["idle"] for r in everyone],
                       "exact_syncs": everyone[0]["exact"]}, f)
    dist.destroy_process_group()


def run(call, world, tmp, name):
    out = os.path.join(tmp, name + ".json")
    mp.spawn(run_replica, args=(world, *call, f"file://{os.path.join(tmp, name + '.store')}", out), nprocs=world)
    with open(out) as f:
        return json.load(f)


def loss_at(curve, total):
    """The validation loss where the replicas had taken `total` inner steps in all
    (linear between the snapshots and the end; `total` is at most the run's)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= total <= t1:
            return l0 + (l1 - l0) * (total - t0) / max(t1 - t0, 1)
    return curve[-1][1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="gpt")
    parser.add_argument("--speeds", nargs="+", type=float, default=[1.0, 2.0],
                        help="each replica's slowdown factor (one replica per entry)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--sync-every", type=int, default=32, help="the step schedule's H")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=40, help="fragment syncs per run (both schedules)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time schedule runs per seed (its syncs fall at other steps run to run, so its loss "
                             "moves between runs of one seed; the step schedule's does not, with auto off)")
    parser.add_argument("--auto", action="store_true",
                        help="leave CGX_COMPRESSION_AUTO on (default: off, every sync compressed at 4 bits, so "
                             "that the two schedules differ in their schedule alone)")
    parser.add_argument("--out", default=default_output("unequal"))
    args = parser.parse_args()
    if not args.auto:
        os.environ["CGX_COMPRESSION_AUTO"] = "0"  # (the spawned replicas read it)
    os.makedirs(args.out, exist_ok=True)
    world = len(args.speeds)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            call = [args.task, seed, args.speeds, "step", args.sync_every, args.fragments, args.syncs, 0.0]
            print(f"[{args.task} seed {seed}] step schedule ...", flush=True)
            by_step = run(call, world, tmp, f"step-{seed}")
            call[3], call[7] = "time", by_step["seconds"] / (args.syncs / args.fragments)
            by_time = []
            for repeat in range(args.repeats):
                print(f"[{args.task} seed {seed}] time schedule, interval {call[7]:.2f} s, run {repeat + 1} ...",
                      flush=True)
                by_time.append(run(call, world, tmp, f"time-{seed}-{repeat}"))
            tokens = min(sum(x["steps"]) for x in [by_step] + by_time)  # every run got that far
            for x in [by_step] + by_time:
                x["val_loss_at_equal_tokens"] = loss_at(x["curve"], tokens)
            runs.append({"seed": seed, "interval_s": call[7], "step": by_step, "time": by_time})
    speeds = "-".join(f"{s:g}" for s in args.speeds)
    print(f"\n{args.task}, replicas at speeds 1/{' 1/'.join(f'{s:g}' for s in args.speeds)}, "
          f"{args.syncs} syncs of {args.fragments} fragments, step schedule H={args.sync_every}, "
          f"torch {torch.__version__}")
    print("| seed | schedule | s | inner steps per replica | idle per replica | syncs sent exactly | val loss (end) | "
          "vs step | val loss at equal tokens | vs step |")
    print("|---:|---|---:|---|---|---:|---:|---:|---:|---:|")
    ratios, ratios_tokens = [], []  # time against step, each time run against its seed's step run
    for r in runs:
        for name, x in [("step", r["step"])] + [("time", x) for x in r["time"]]:
            at = x["val_loss_at_equal_tokens"]
            vs = vs_tokens = ""
            if name == "time":
                ratios.append(x["val_loss"] / r["step"]["val_loss"] - 1)
                ratios_tokens.append(at / r["step"]["val_loss_at_equal_tokens"] - 1)
                vs, vs_tokens = f"{ratios[-1]:+.2%}", f"{ratios_tokens[-1]:+.2%}"
            print(f"| {r['seed']} | {name} | {x['seconds']:.1f} | {' / '.join(map(str, x['steps']))} | "
                  f"{' / '.join(f'{i:.1%}' for i in x['idle'])} | {x['exact_syncs']} | {x['val_loss']:.4f} | {vs} | "
                  f"{at:.4f} | {vs_tokens} |")

    def mean(values):
        return sum(values) / len(values)

    def spread(values):  # the mean's standard error (n - 1 in the variance); 0 for one value
        n = len(values)
        return (sum((v - mean(values)) ** 2 for v in values) / (n - 1) / n) ** 0.5 if n > 1 else 0.0

    times = [x for r in runs for x in r["time"]]
    print(f"mean of {len(runs)} seeds ({len(times)} time schedule runs): val loss step "
          f"{mean([r['step']['val_loss'] for r in runs]):.4f}, time {mean([x['val_loss'] for x in times]):.4f} "
          f"(equal wall clock); at equal tokens step "
          f"{mean([r['step']['val_loss_at_equal_tokens'] for r in runs]):.4f}, "
          f"time {mean([x['val_loss_at_equal_tokens'] for x in times]):.4f}; time vs step, mean of the runs' ratios "
          f"+- its standard error: {mean(ratios):+.2%} +- {spread(ratios):.2%} (equal wall clock), "
          f"{mean(ratios_tokens):+.2%} +- {spread(ratios_tokens):.2%} (equal tokens); most idle replica: step "
          f"{max(max(r['step']['idle']) for r in runs):.1%}, time {max(max(x['idle']) for x in times):.1%}")
    path = os.path.join(args.out, f"{args.task}-{speeds}.json")
    with open(path, "w") as f:
        json.dump({"task": args.task, "speeds": args.speeds, "sync_every": args.sync_every,
                   "fragments": args.fragments, "syncs": args.syncs, "runs": runs}, f)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
