"""Elastic DiLoCo beside torchft: the same run, the same kills, both libraries.

3 replicas of one rank each (--replicas), processes on this machine (cgx's replicas are given
separate CGX_HOSTNAMEs, so their traffic goes over TCP as torchft's Gloo does, and
CGX_COMPRESSION_AUTO=0, so every sync is compressed as across sites), train a
small MLP (4 layers, 38,538 parameters; a teacher network's 10 classes) with Streaming
DiLoCo: H=32 in 4 fragments (a fragment sync every 8 inner steps), no overlap, inner
AdamW, outer Nesterov SGD (lr 0.7, momentum 0.9). An inner step takes --step-ms (the
model's compute is ~1 ms; the rest is a sleep, so the replicas do not compete for the
cores and the run is long enough for healing to show).

  cgx      cgx.DiLoCo(bits=4, or --bits) over cgx.elastic.Membership (the c10d rendezvous store in
           replica 0)
  torchft  torchft 0.2.0's DiLoCo and Manager over its Gloo process group, with the
           Lighthouse binary its wheel ships (pip install 'cgx[bench]'); it sends
           float32 on CPU (its quantization needs Triton)

Scenarios: "full" (uninterrupted), "kill-restart" (the last replica killed with SIGKILL
at 1/3 of the steps, a new process started at 2/3) and "chaos" (every --chaos-every steps
of replica 0 a replica other than 0, drawn from the seed, is killed and started again
--chaos-down seconds later; one down at a time, none killed in the last fifth: the same
schedule for both libraries). With --link, every replica runs on an emulated host of its
own (benchmarks/netemu.py: a network namespace behind a link of that rate; root), the
rendezvous store and the Lighthouse on replica 0's. Tunings: "default" (each library's defaults:
cgx heartbeat 5 s and roll call 2 s; torchft heartbeat timeout 5 s) and "fast" (cgx
heartbeat 1 s and roll call 0.5 s; torchft heartbeat timeout 1 s). Every timeout of a
collective is --group-timeout for both.

    python benchmarks/elastic_vs_torchft.py                      # both, both tunings
    python benchmarks/elastic_vs_torchft.py --libraries cgx --tunings fast --seeds 0 1 2
    python benchmarks/elastic_vs_torchft.py --scenarios full chaos --tunings default --link 10mbit --steps 2304

Reports per run: the payload bytes of a sync, the final validation loss of the global
weights, from the kill to the moment every survivor has completed a sync, from the new
process's start to its first sync, the survivors' longest stall while the joiner is
admitted (their longest inner step then, less their median step), the bytes of state a
joiner received against the model's float32 size, and whether the live replicas' global
weights are bit-identical at the end; under chaos, the failures, replica 0's wait from
each kill to its next sync, each joiner's first sync, and the run's wall clock against
the uninterrupted run's (what the failures cost). Writes <out>/elastic_vs_torchft.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here

from launch import free_port  # noqa: E402
from outputs import default_output, parent_made, read_progress, write_progress  # noqa: E402
from plotting import pyplot  # noqa: E402

LIBRARIES = ("cgx", "torchft")
SCENARIOS = ("full", "kill-restart", "chaos")
TUNINGS = {  # seconds
    "default": {"cgx": {"heartbeat": 5, "roll_call": 2.0}, "torchft": {"heartbeat_timeout": 5.0}},
    "fast": {"cgx": {"heartbeat": 1, "roll_call": 0.5}, "torchft": {"heartbeat_timeout": 1.0}},
}
SYNC_EVERY, FRAGMENTS = 32, 4
WIDTHS = (32, 128, 128, 128, 10)


# ---- the task (the same for both libraries)

def _model():
    import torch

    layers = [torch.nn.Linear(a, b) for a, b in zip(WIDTHS[:-1], WIDTHS[1:])]
    model = torch.nn.Sequential()
    for i, layer in enumerate(layers):
        model.append(layer)
        if i < len(layers) - 1:
            model.append(torch.nn.ReLU())
    return model, layers


def _teacher_labels(x):
    import torch

    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(WIDTHS[0], 64, generator=g), torch.randn(64, WIDTHS[-1], generator=g)
    return (torch.tanh(x @ w1) @ w2).argmax(dim=1)


def _batch(slot: int, step: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + slot * 100_003 + step)
    x = torch.randn(64, WIDTHS[0], generator=g)
    return x, _teacher_labels(x)


def _validation_loss(model) -> float:
    import torch

    g = torch.Generator().manual_seed(99)
    x = torch.randn(4096, WIDTHS[0], generator=g)
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), _teacher_labels(x)).item()


def _digest(weights: dict) -> str:
    digest = hashlib.blake2b(digest_size=12)
    for name in sorted(weights):
        digest.update(weights[name].detach().contiguous().view(-1).numpy().tobytes())
    return digest.hexdigest()


# ---- one replica (a process)

class _Record:
    """What a replica writes as it goes: every step's time, step and loss, and each
    completed sync's time (the driver reads replica 0's step from `progress`)."""

    def __init__(self, config: dict) -> None:
        self.config, self.steps, self.syncs = config, [], []
        self.sent = []  # (when, bytes of state sent to replicas taking it so far), at each change
        self._pace = config["step_ms"] / 1000

    def step(self, started: float, step: int, loss: float, synced: bool) -> None:
        left = self._pace - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        now = time.time()
        self.steps.append((now, step, loss))
        if synced and not self.syncs:  # kept where this process is killed before it writes its record
            with open(self.config["out"] + ".first_sync", "w") as f:
                f.write(str(now))
        if synced:
            self.syncs.append(now)
        if self.config["slot"] == 0:
            write_progress(self.config["progress"], step)

    def write(self, **more) -> None:
        with open(self.config["out"], "w") as f:
            json.dump({"steps": self.steps, "syncs": self.syncs, "sent": self.sent, **more}, f)


def cgx_replica(config: dict) -> None:
    import torch

    import cgx

    slot, tuning = config["slot"], TUNINGS[config["tuning"]]["cgx"]
    torch.manual_seed(config["seed"])
    model, _ = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seconds = datetime.timedelta(seconds=1)
    membership = cgx.elastic.Membership(f"{config['host0']}:{config['port']}", config["run_id"], is_host=slot == 0,
                                        min_replicas=2, heartbeat=tuning["heartbeat"] * seconds,
                                        roll_call=tuning["roll_call"] * seconds,
                                        group_timeout=config["group_timeout"] * seconds)
    store = torch.distributed.TCPStore(config["host0"], config["port"], is_master=False,
                                       timeout=datetime.timedelta(seconds=600))
    record = _Record(config)
    try:
        diloco = cgx.DiLoCo(model, inner, sync_every=SYNC_EVERY, fragments=FRAGMENTS, bits=config.get("bits", 4),
                            overlap=0, membership=membership)
    except cgx.MembershipError:  # started as the run ended
        store.set(f"bench-done/{slot}", "1")
        return
    synced = 0
    while diloco.step < config["steps"]:
        started = time.perf_counter()
        x, y = _batch(slot, diloco.step, config["seed"])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        inner.step()
        inner.zero_grad()
        stats = diloco.stats()
        record.step(started, diloco.step, loss.item(), stats["outer_syncs"] > synced)
        synced = stats["outer_syncs"]
        if stats["bytes_to_joiners"] != (record.sent[-1][1] if record.sent else 0):
            record.sent.append((time.time(), stats["bytes_to_joiners"]))
    diloco.close()
    stats = dict(diloco.stats())
    weights = diloco.state_dict()["global_weights"]
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, weight in weights.items():
            params[name].copy_(weight)
    record.write(digest=_digest(weights), val_loss=_validation_loss(model),
                 payload_bytes_per_sync=stats["payload_bytes"] / max(stats["outer_syncs"], 1),
                 state_received=None,
                 float32_bytes=sum(p.numel() * 4 for p in model.parameters()))
    if slot == 0:  # the store's host goes last
        membership.end_run()
        store.wait([f"bench-done/{s}" for s in range(1, config["replicas"])])
    else:
        store.set(f"bench-done/{slot}", "1")
    membership.close()


def torchft_replica(config: dict) -> None:
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo

    slot, seed, address = config["slot"], config["seed"], config["address"]
    torch.manual_seed(seed)
    model, layers = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = [torch.optim.SGD(layer.parameters(), lr=0.7, momentum=0.9, nesterov=True) for layer in layers]
    received = []  # the bytes of state this replica received as it joined (tensors)

    class Transport(HTTPTransport):
        """torchft's checkpoint transport, at this replica's address (torchft's gives the
        machine's host name, which an emulated host cannot reach), counting what it
        receives."""

        def address(self) -> str:
            return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

        def recv_checkpoint(self, *args, **kwargs):
            state = super().recv_checkpoint(*args, **kwargs)
            received.append(_tensor_bytes(state))
            return state
    port = free_port()  # this replica's own store (its group of one rank), served while the Manager runs
    store = torch.distributed.TCPStore(address, port, is_master=True, wait_for_workers=False)  # noqa: F841
    timeout = datetime.timedelta(seconds=config["group_timeout"])
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                                     None if config.get("cold_optimizer") else
                                                     inner.load_state_dict(state["inner"])),
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                      replica_id=f"replica_{slot}", store_addr=address, store_port=port, rank=0, world_size=1,
                      hostname=address, checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
                      lighthouse_addr=f"http://{config['host0']}:{config['lighthouse_port']}", timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout, init_sync=False)
    record = _Record(config)
    total_syncs = config["steps"] // (SYNC_EVERY // FRAGMENTS)
    with DiLoCo(manager, layers, inner, outer, sync_every=SYNC_EVERY, backup_device=torch.device("cpu"),
                pin_memory=False, fragment_sync_delay=0) as diloco:
        synced = manager.current_step()
        step = synced * (SYNC_EVERY // FRAGMENTS)
        while manager.current_step() < total_syncs:
            started = time.perf_counter()
            x, y = _batch(slot, step, seed)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            inner.zero_grad()
            loss.backward()
            inner.step()
            syncs = manager.current_step()
            if syncs != synced:  # a joiner's step is the run's (its first sync set it)
                step = syncs * (SYNC_EVERY // FRAGMENTS)
            else:
                step += 1
            record.step(started, step, loss.item(), syncs > synced)
            synced = syncs
        weights = {f"{2 * i}.{name}": t.clone() for i, f in enumerate(diloco._fragments)
                   for name, t in f.original_parameters.items()}
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, weight in weights.items():
            params[name].copy_(weight)
    record.write(digest=_digest(weights), val_loss=_validation_loss(model),
                 payload_bytes_per_sync=sum(p.numel() * 4 for p in model.parameters()) / FRAGMENTS,
                 state_received=sum(received) if received else None,
                 float32_bytes=sum(p.numel() * 4 for p in model.parameters()))
    manager.shutdown(wait=False)


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


# ---- the driver

def run(library: str, scenario: str, tuning: str, seed: int, args, tmp: str) -> dict:
    from netemu import EmulatedHosts

    name = f"{library}-{scenario}-{tuning}-{seed}"
    progress = os.path.join(tmp, name + ".progress")
    port = free_port()
    procs: dict[int, subprocess.Popen] = {}
    outputs: dict[int, list[str]] = {s: [] for s in range(args.replicas)}
    events: list[tuple[str, float, int]] = []  # (kill or restart, when, slot), in order
    rng = random.Random(seed)
    hosts = EmulatedHosts(args.replicas, rate=args.link) if args.link else None

    def address(slot: int) -> str:
        return hosts.address(slot) if hosts else "127.0.0.1"

    def popen(slot: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return hosts.popen(slot, argv, **kwargs) if hosts else subprocess.Popen(argv, **kwargs)

    def start(slot: int) -> None:
        out = os.path.join(tmp, f"{name}-{slot}-{len(outputs[slot])}.json")
        outputs[slot].append(out)
        config = {"library": library, "slot": slot, "seed": seed, "steps": args.steps, "tuning": tuning,
                  "replicas": args.replicas, "address": address(slot), "host0": address(0),
                  "run_id": name, "port": port, "lighthouse_port": port, "progress": progress, "out": out,
                  "step_ms": args.step_ms, "group_timeout": args.group_timeout, "bits": args.bits,
                  "cold_optimizer": args.torchft_cold_optimizer}
        with open(out + ".config", "w") as f:
            json.dump(config, f)
        # Compressed always (auto would send these small syncs exactly over loopback: a
        # site-to-site link is what the bytes are for).
        env = dict(os.environ, CGX_HOSTNAME=f"bench-host-{slot}", CGX_COMPRESSION_AUTO="0", OMP_NUM_THREADS="1")
        if hosts:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        log = open(out + ".log", "w")
        procs[slot] = popen(slot, [sys.executable, "-P", os.path.abspath(__file__), "--replica", out + ".config"],
                            env=env, stdout=log, stderr=log)

    started = time.time()
    with hosts or contextlib.nullcontext():
        lighthouse = None
        if library == "torchft":
            binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable),
                                                                          "torchft_lighthouse")
            heartbeat_ms = int(TUNINGS[tuning]["torchft"]["heartbeat_timeout"] * 1000)
            lighthouse = popen(0, [binary, "--min_replicas", "2", "--join_timeout_ms", "10000",
                                   "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"[::]:{port}"],
                               stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, name + ".lh"), "w"))
        try:
            for slot in range(args.replicas):
                start(slot)
            down: dict[int, float] = {}  # slot -> when it starts again (-1: at 2/3 of the steps)
            next_kill = {"full": args.steps + 1, "kill-restart": args.steps // 3}.get(scenario, args.chaos_every)
            while procs[0].poll() is None:
                if time.time() - started > args.timeout:
                    raise TimeoutError(f"{name}: over {args.timeout} s")
                step = read_progress(progress)
                if step >= next_kill and step < 0.8 * args.steps and not down:
                    victim = args.replicas - 1 if scenario == "kill-restart" else rng.randrange(1, args.replicas)
                    procs[victim].send_signal(signal.SIGKILL)
                    procs[victim].wait()
                    events.append(("kill", time.time(), victim))
                    if scenario == "kill-restart":
                        down[victim], next_kill = -1.0, args.steps + 1  # once
                    else:
                        down[victim], next_kill = time.time() + args.chaos_down, step + args.chaos_every
                for slot, when in list(down.items()):
                    if (when < 0 and step >= 2 * args.steps // 3) or (0 <= when <= time.time()):
                        del down[slot]
                        events.append(("restart", time.time(), slot))
                        start(slot)
                for slot, p in procs.items():
                    if p.poll() not in (None, 0) and slot not in down:
                        raise RuntimeError(f"{name}: replica {slot} failed ({p.returncode}); "
                                           f"log {outputs[slot][-1]}.log")
                time.sleep(0.02)
            for p in procs.values():
                p.wait(timeout=120)
            if procs[0].returncode != 0:
                raise RuntimeError(f"{name}: replica 0 failed ({procs[0].returncode}); log {outputs[0][-1]}.log")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            if lighthouse is not None:
                lighthouse.kill()
                lighthouse.wait()
    seconds = time.time() - started
    records = {slot: [json.load(open(o)) if os.path.exists(o) else None for o in outs]
               for slot, outs in outputs.items()}
    live = {slot: rs[-1] for slot, rs in records.items() if rs[-1] is not None}
    losses = [loss for _, _, loss in live[0]["steps"]]
    times = [t - started for t, _, _ in live[0]["steps"]]
    every = SYNC_EVERY // FRAGMENTS  # the loss curve: replica 0's mean loss between syncs
    curve = [(times[i + every - 1], statistics.mean(losses[i:i + every]))
             for i in range(0, len(losses) - every + 1, every)]
    result = {"library": library, "scenario": scenario, "tuning": tuning, "seed": seed, "steps": args.steps,
              "replicas": args.replicas, "link": args.link or "loopback",
              "curve": curve, "events": [(what, when - started, slot) for what, when, slot in events],
              "val_loss": live[0]["val_loss"], "payload_bytes_per_sync": live[0]["payload_bytes_per_sync"],
              "float32_bytes": live[0]["float32_bytes"], "seconds": seconds,
              "identical": len({r["digest"] for r in live.values()}) == 1}
    kills = [(when, slot) for what, when, slot in events if what == "kill"]
    restarts = [(when, slot) for what, when, slot in events if what == "restart"]
    # Each restart's output, in order per slot (the first of a slot is its first start).
    joined = [outputs[slot][1 + sum(1 for _, s in restarts[:i] if s == slot)] for i, (_, slot) in enumerate(restarts)]
    result["failures"] = len(kills)
    result["restart_to_first_sync_s"] = [float(open(out + ".first_sync").read()) - when
                                         if os.path.exists(out + ".first_sync") else None
                                         for out, (when, _) in zip(joined, restarts)]
    if scenario == "kill-restart":
        (kill, victim), = kills
        (restart, _), = restarts
        survivors = [live[s] for s in range(args.replicas) if s != victim]
        result["kill_to_next_sync_s"] = max(next(t for t in r["syncs"] if t > kill) for r in survivors) - kill
        joiner = records[victim][1]
        if joiner is None:
            raise RuntimeError(f"{name}: the restarted replica left no record; log {outputs[victim][-1]}.log")
        result["restart_to_first_sync_s"] = result["restart_to_first_sync_s"][0]
        result["stall_at_admission_s"] = max(_stall(r["steps"], restart, joiner["syncs"][0] + 1.0)
                                             for r in survivors)
        # cgx: what the survivors sent since the restart (a survivor behind at the kill took state too)
        sent = sum(max((b for t, b in r["sent"] if t >= restart), default=0)
                   - max((b for t, b in r["sent"] if t < restart), default=0) for r in survivors)
        result["state_to_joiner_bytes"] = joiner["state_received"] if library == "torchft" else sent
    elif kills:  # chaos: replica 0 lives throughout; its wait from each kill to its next sync
        result["kill_to_next_sync_s"] = [next((t for t in live[0]["syncs"] if t > kill), seconds + started) - kill
                                         for kill, _ in kills]
        # Replica 0's inner steps while the killed one was away (from its kill to its restart's
        # first sync): steps whose average lacks a replica's progress (one victim at a time).
        # (A restart that never synced (killed first) counts as away until the next kill.)
        ends = [k for k, _ in kills[1:]] + [seconds + started]
        back = [when + first if first is not None else end
                for (when, _), first, end in zip(restarts, result["restart_to_first_sync_s"], ends)]
        result["steps_with_a_replica_missing"] = sum(1 for t, _, _ in live[0]["steps"]
                                                     if any(k <= t <= b for (k, _), b in zip(kills, back)))
    return result


def _plot(results: list[dict], seed: int, path: str) -> None:
    """Replica 0's training loss against wall clock in the kill-restart and chaos runs of
    `seed`, a panel per scenario and tuning, both libraries, the kills and restarts marked."""
    plt = pyplot()
    runs = [r for r in results if r["scenario"] in ("kill-restart", "chaos") and r["seed"] == seed]
    if plt is None or not runs:
        return
    panels = list(dict.fromkeys((r["scenario"], r["tuning"]) for r in runs))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (scenario, tuning) in zip(axes[0], panels):
        for r, color in zip([r for r in runs if (r["scenario"], r["tuning"]) == (scenario, tuning)],
                            ("tab:blue", "tab:orange")):
            ax.plot(*zip(*r["curve"]), color=color, label=r["library"])
            for what, when, _ in r["events"]:
                ax.axvline(when, color=color, linestyle=":" if what == "kill" else "--", linewidth=1)
        ax.set(title=f"{scenario}, {tuning} detection (dotted: kill, dashed: restart)", xlabel="wall clock, s",
               ylabel="replica 0's training loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(parent_made(path), dpi=100)
    print(f"wrote {path}")


def _stall(steps: list, since: float, until: float) -> float:
    """The longest inner step between `since` and `until`, less the median step."""
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
    during = [b[0] - a[0] for a, b in zip(steps, steps[1:]) if since <= b[0] <= until]
    return max(during, default=0.0) - statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--tunings", nargs="+", choices=list(TUNINGS), default=list(TUNINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--replicas", type=int, default=3,
                        help="replicas of the run (the last is killed and started again)")
    parser.add_argument("--steps", type=int, default=768)
    parser.add_argument("--step-ms", type=float, default=40.0, help="the least time an inner step takes")
    parser.add_argument("--group-timeout", type=int, default=30, help="every collective's timeout, s (both)")
    parser.add_argument("--bits", type=int, default=4, help="cgx's outer gradients' bits (32: exact)")
    parser.add_argument("--torchft-cold-optimizer", action="store_true",
                        help="torchft's joiner loads the local weights it receives but not the inner optimizer's "
                             "state (its AdamW starts cold, as cgx's joiner's does)")
    parser.add_argument("--chaos-every", type=int, default=192, help="chaos: steps of replica 0 between kills")
    parser.add_argument("--chaos-down", type=float, default=3.0, help="chaos: seconds a killed replica stays down")
    parser.add_argument("--link", help="each replica on an emulated host behind a link of this rate (e.g. 10mbit; "
                                       "root); default: all on this machine's loopback")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--out", default=default_output("elastic_vs_torchft"))
    parser.add_argument("--png", help="where to draw the loss curves (default: in --out)")
    parser.add_argument("--logs", help="keep the replicas' logs and records in this folder (default: a temporary one)")
    args = parser.parse_args()
    results = []
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    with (contextlib.nullcontext(args.logs) if args.logs else tempfile.TemporaryDirectory()) as tmp:
        for seed in args.seeds:
            for scenario in args.scenarios:
                for tuning in args.tunings if scenario != "full" else args.tunings[:1]:
                    for library in args.libraries:  # alternated, run by run
                        print(f"[{library} {scenario} {tuning} seed {seed}] ...", flush=True)
                        results.append(run(library, scenario, tuning, seed, args, tmp))
                        print("  " + json.dumps({k: v for k, v in results[-1].items() if k != "curve"}), flush=True)
    print(f"\nelastic DiLoCo beside torchft: {args.replicas} replicas, MLP, H={SYNC_EVERY}, {FRAGMENTS} fragments, "
          f"{args.steps} steps of >= {args.step_ms:g} ms, seeds {args.seeds}, link {args.link or 'loopback'}")
    print("| | " + " | ".join(f"{lib} {t}" for t in args.tunings for lib in args.libraries) + " |")
    print("|---|" + "---:|" * (len(args.tunings) * len(args.libraries)))
    rows = [("payload bytes a sync", "payload_bytes_per_sync", "{:,.0f}", "kill-restart"),
            ("final loss, uninterrupted", "val_loss", "{:.4f}", "full"),
            ("final loss, kill and restart", "val_loss", "{:.4f}", "kill-restart"),
            ("kill -> survivors' next completed sync, s", "kill_to_next_sync_s", "{:.2f}", "kill-restart"),
            ("restart -> the joiner's first sync, s", "restart_to_first_sync_s", "{:.2f}", "kill-restart"),
            ("survivors' stall when the joiner is admitted, s", "stall_at_admission_s", "{:.2f}", "kill-restart"),
            ("state sent to the joiner / model", "state_ratio", "{:.1f}x", "kill-restart"),
            ("global weights bit-identical", "identical", "{}", "kill-restart"),
            ("chaos: replicas killed and restarted", "failures", "{:.0f}", "chaos"),
            ("chaos: final loss", "val_loss", "{:.4f}", "chaos"),
            ("chaos: final loss against uninterrupted", "loss_vs_full", "{:+.2%}", "chaos"),
            ("chaos: wall clock lost to the failures, s", "failure_cost_s", "{:.1f}", "chaos"),
            ("chaos: kill -> replica 0's next sync, s (median)", "kill_to_next_sync_median", "{:.2f}", "chaos"),
            ("chaos: restart -> the joiner's first sync, s (median)", "first_sync_median", "{:.2f}", "chaos"),
            ("chaos: replica 0's steps with a replica missing", "steps_with_a_replica_missing", "{:.0f}", "chaos"),
            ("chaos: global weights bit-identical", "identical", "{}", "chaos")]
    for r in results:
        if r.get("state_to_joiner_bytes") is not None:
            r["state_ratio"] = r["state_to_joiner_bytes"] / r["float32_bytes"]
        full = next((f for f in results if f["scenario"] == "full" and f["library"] == r["library"]
                     and f["seed"] == r["seed"]), None)
        if r["scenario"] == "chaos":
            if full is not None:
                r["loss_vs_full"] = r["val_loss"] / full["val_loss"] - 1
                r["failure_cost_s"] = r["seconds"] - full["seconds"]
            if r.get("kill_to_next_sync_s"):
                r["kill_to_next_sync_median"] = statistics.median(r["kill_to_next_sync_s"])
            firsts = [t for t in r["restart_to_first_sync_s"] if t is not None]
            if firsts:
                r["first_sync_median"] = statistics.median(firsts)
    for label, key, form, scenario in rows:
        cells = []
        for tuning in args.tunings:
            for library in args.libraries:
                values = [r[key] for r in results if r["library"] == library and r["scenario"] == scenario
                          and (r["tuning"] == tuning or scenario == "full") and r.get(key) is not None]
                if not values:
                    cells.append("")
                elif isinstance(values[0], bool):
                    cells.append("yes" if all(values) else "no")
                else:
                    cells.append("-".join(dict.fromkeys(form.format(v) for v in (min(values), max(values)))))
        if any(cells):
            print(f"| {label} | " + " | ".join(cells) + " |")
    os.makedirs(args.out, exist_ok=True)
    _plot(results, args.seeds[0], args.png or os.path.join(args.out, "elastic_vs_torchft.png"))
    path = os.path.join(args.out, "elastic_vs_torchft.json")
    with open(path, "w") as f:
        json.dump({"steps": args.steps, "step_ms": args.step_ms, "link": args.link or "loopback",
                   "when": time.strftime("%Y-%m-%d"), "machine": socket.gethostname(), "results": results}, f,
                  indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replica":
        with open(sys.argv[2]) as f:
            replica_config = json.load(f)
        {"cgx": cgx_replica, "torchft": torchft_replica}[replica_config["library"]](replica_config)
    else:
        main()
