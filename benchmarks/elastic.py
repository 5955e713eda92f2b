"""Elastic Streaming DiLoCo under failures: replicas killed and restarted while the run goes on.

Each replica is its own process on its own emulated host (benchmarks/netemu.py; root),
behind a link of --link's rate, training the GPT task of benchmarks/train.py with
cgx.DiLoCo (H=32, P=4, 4-bit outer gradients, overlap 1) over a cgx.elastic.Membership
(the c10d rendezvous store on replica 0's host). Scenarios:

  full3         3 replicas, uninterrupted
  two           2 replicas, uninterrupted
  kill-restart  3 replicas; replica 2 killed (SIGKILL) at 1/3 of the steps, restarted at 2/3
  chaos         3 replicas; every --chaos-every steps of replica 0 a random replica other
                than the store's host is killed, and restarted --chaos-down seconds later;
                no kill in the last fifth of the run

    python benchmarks/elastic.py --scenarios full3 two kill-restart --seeds 0 1 2 --link 10mbit
    python benchmarks/elastic.py --scenarios chaos --steps 1200 --link 10mbit

Reports per run: the final validation loss of the global weights (equal on every
replica), the failures survived, from each kill to the survivors' next completed sync,
from each restart to the joiner's first sync (and to its admission; measured for the
replicas that lived to the end, as a killed one's record is lost), and the bytes of state
sent to joiners against the model's float32 size. Writes <out>/elastic.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here

from outputs import default_output, read_progress, write_progress  # noqa: E402

PORT = 29400
SCENARIOS = ("full3", "two", "kill-restart", "chaos")


# ---- one replica (a process on an emulated host)

def replica_main(config_path: str) -> None:
    import torch

    import cgx
    from train import TASKS

    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    slot, seed, steps = config["slot"], config["seed"], config["steps"]
    task = TASKS["gpt"]()
    torch.manual_seed(seed)
    model = task.model()
    inner = torch.optim.AdamW(model.parameters(), lr=task.lr)
    membership = cgx.elastic.Membership(f"{config['endpoint']}:{PORT}", config["run_id"], is_host=slot == 0,
                                        min_replicas=config["min_replicas"],
                                        group_timeout=datetime.timedelta(seconds=config["group_timeout"]))
    store = torch.distributed.TCPStore(config["endpoint"], PORT, is_master=False,
                                       timeout=datetime.timedelta(seconds=600))
    asked = time.time()
    try:
        diloco = cgx.DiLoCo(model, inner, sync_every=32, fragments=4, bits=4, overlap=1, membership=membership)
    except cgx.MembershipError:  # restarted as the run ended
        store.set(f"bench-done/{slot}", "1")
        return
    record = {"slot": slot, "asked": asked, "admitted": time.time(), "first_step": diloco.step,
              "syncs": [], "losses": []}
    progress = config["progress"]
    done = 0
    while diloco.step < steps:
        x, y = task.batch_for(slot, diloco.step, seed)
        loss = task.loss(model, x, y)
        loss.backward()
        inner.step()
        inner.zero_grad()
        record["losses"].append((diloco.step, loss.item()))
        if diloco.stats()["outer_syncs"] > done:
            done = diloco.stats()["outer_syncs"]
            record["syncs"].append((time.time(), diloco.step))
        if slot == 0:
            write_progress(progress, diloco.step)
    diloco.close()
    record["stats"] = dict(diloco.stats())
    if slot == 0:
        with torch.no_grad():  # the global weights, equal on every replica
            params = dict(model.named_parameters())
            for name, weight in diloco.state_dict()["global_weights"].items():
                params[name].copy_(weight)
        record.update(task.evaluate(model))
        record["float32_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    with open(config["out"], "w") as f:
        json.dump(record, f)
    # The store's host goes last: it waits until every other replica has finished.
    if slot == 0:
        membership.end_run()
        store.wait([f"bench-done/{s}" for s in range(1, config["replicas"])])
    else:
        store.set(f"bench-done/{slot}", "1")
    membership.close()


# ---- the driver

def run(scenario: str, seed: int, steps: int, link: str | None, args, tmp: str) -> dict:
    from netemu import EmulatedHosts

    replicas = 2 if scenario == "two" else 3
    progress = os.path.join(tmp, f"{scenario}-{seed}.progress")
    events: list[tuple[str, float, int]] = []  # (what, when, slot)
    procs: dict[int, subprocess.Popen] = {}
    outputs: dict[int, list[str]] = {s: [] for s in range(replicas)}
    rng = random.Random(seed)

    def start(hosts, slot):
        out = os.path.join(tmp, f"{scenario}-{seed}-{slot}-{len(outputs[slot])}.json")
        outputs[slot].append(out)
        config = os.path.join(tmp, os.path.basename(out) + ".config")
        with open(config, "w") as f:
            json.dump({"slot": slot, "seed": seed, "steps": steps, "endpoint": hosts.address(0),
                       "run_id": f"{scenario}-{seed}", "min_replicas": 2,
                       "replicas": replicas, "progress": progress, "out": out,
                       "group_timeout": args.group_timeout}, f)
        env = dict(os.environ, CGX_HOSTNAME=f"emulated-host-{slot}", GLOO_SOCKET_IFNAME="eth0")
        log = open(out + ".log", "w")
        procs[slot] = hosts.popen(slot, [sys.executable, "-P", os.path.abspath(__file__), "--replica", config],
                                  env, stderr=log, stdout=log)

    started = time.time()
    with EmulatedHosts(replicas, rate=link) as hosts:
        for slot in range(replicas):
            start(hosts, slot)
        down: dict[int, float] = {}  # slot -> when to restart it
        next_kill = steps // 3 if scenario == "kill-restart" else args.chaos_every
        while procs[0].poll() is None:
            if time.time() - started > args.timeout:
                raise TimeoutError(f"{scenario} seed {seed}: over {args.timeout} s")
            now, step = time.time(), read_progress(progress)
            if scenario in ("kill-restart", "chaos") and step >= next_kill and step < 0.8 * steps and not down:
                victim = 2 if scenario == "kill-restart" else rng.choice([s for s in range(1, replicas)])
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                events.append(("kill", time.time(), victim))
                if scenario == "kill-restart":
                    down[victim] = -1.0  # restarted at 2/3 of the steps
                    next_kill = steps  # once
                else:
                    down[victim] = time.time() + args.chaos_down
                    next_kill = step + args.chaos_every
            for slot, when in list(down.items()):
                if (when < 0 and step >= 2 * steps // 3) or (when >= 0 and now >= when):
                    del down[slot]
                    start(hosts, slot)
                    events.append(("restart", time.time(), slot))
            for slot, p in procs.items():
                if slot not in down and p.poll() not in (None, 0):
                    raise RuntimeError(f"{scenario} seed {seed}: replica {slot} failed ({p.returncode}); "
                                       f"log: {outputs[slot][-1]}.log")
            time.sleep(0.1)
        for p in procs.values():
            p.wait(timeout=120)
        wire = sum(hosts.bytes_sent())
    records = {slot: [json.load(open(o)) for o in outs if os.path.exists(o)] for slot, outs in outputs.items()}
    host = records[0][0]
    kills = [(t, s) for what, t, s in events if what == "kill"]
    restarts = [(t, s) for what, t, s in events if what == "restart"]
    host_syncs = [t for t, _ in host["syncs"]]
    to_next_sync = [next((t - k for t in host_syncs if t > k), None) for k, _ in kills]
    joins = []
    for t, slot in restarts:
        joiner = next((r for r in records[slot] if abs(r["asked"] - t) < 30), None)
        if joiner is not None and joiner["syncs"]:
            joins.append({"to_asked": joiner["asked"] - t, "to_admitted": joiner["admitted"] - t,
                          "to_first_sync": joiner["syncs"][0][0] - t, "at_step": joiner["first_step"]})
    bytes_to_joiners = sum(r["stats"]["bytes_to_joiners"] for rs in records.values() for r in rs)
    return {"scenario": scenario, "seed": seed, "steps": steps, "link": link or "unshaped",
            "val_loss": host["val_loss"], "failures": len(kills), "restarts": len(restarts),
            "kill_to_next_sync_s": to_next_sync, "joins": joins, "bytes_to_joiners": bytes_to_joiners,
            "float32_bytes": host["float32_bytes"], "seconds": time.time() - started, "wire_bytes": wire,
            "host_stats": host["stats"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=["full3", "two", "kill-restart"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--link", default="10mbit", help="each host's link rate, or 'unshaped'")
    parser.add_argument("--chaos-every", type=int, default=48, help="chaos: steps of replica 0 between kills")
    parser.add_argument("--chaos-down", type=float, default=5.0, help="chaos: seconds a killed replica stays down")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    parser.add_argument("--group-timeout", type=int, default=300,
                        help="each round's group timeout, s (Membership's default: 300); a replica killed while "
                             "it joins stalls the others for up to this long")
    parser.add_argument("--out", default=default_output("elastic"))
    args = parser.parse_args()
    link = None if args.link == "unshaped" else args.link
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for scenario in args.scenarios:
                print(f"[{scenario} seed {seed}] ...", flush=True)
                results.append(run(scenario, seed, args.steps, link, args, tmp))
                r = results[-1]
                print(f"  val_loss {r['val_loss']:.4f}, {r['failures']} failures, kill -> next sync "
                      f"{r['kill_to_next_sync_s']}, joins {r['joins']}, bytes to joiners {r['bytes_to_joiners']:,} "
                      f"(model {r['float32_bytes']:,}), {r['seconds']:.0f} s", flush=True)
    print(f"\nelastic DiLoCo, GPT task, {args.steps} steps, link {args.link}")
    print("| scenario | seeds | val_loss (mean) | per seed | failures | kill -> survivors' next sync, s "
          "| restart -> joiner's first sync, s | state to a joiner / model |")
    print("|---|---:|---:|---|---:|---|---|---:|")
    for scenario in args.scenarios:
        rs = [r for r in results if r["scenario"] == scenario]
        gaps = [g for r in rs for g in r["kill_to_next_sync_s"] if g is not None]
        joins = [j["to_first_sync"] for r in rs for j in r["joins"]]
        restarts = sum(r["restarts"] for r in rs)  # each restart joins once (a killed one's record is lost)
        ratio = (sum(r["bytes_to_joiners"] for r in rs) / restarts / rs[0]["float32_bytes"]) if restarts else None
        per_seed = ", ".join(f"{r['val_loss']:.4f}" for r in rs)
        print(f"| {scenario} | {len(rs)} | {statistics.mean(r['val_loss'] for r in rs):.4f} | "
              f"{per_seed} | {sum(r['failures'] for r in rs)} | "
              f"{_span(gaps)} | {_span(joins)} | {'' if ratio is None else f'{ratio:.2f}'} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "elastic.json")
    with open(path, "w") as f:
        json.dump({"link": args.link, "steps": args.steps, "results": results}, f, indent=1)
    print(f"wrote {path}")


def _span(values: list[float]) -> str:
    return "" if not values else f"{min(values):.1f}-{max(values):.1f} (n={len(values)})"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replica":
        replica_main(sys.argv[2])
    else:
        main()
