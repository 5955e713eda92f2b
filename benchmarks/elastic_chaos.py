"""Chaos soak of elastic DiLoCo beside CPU hogs: kills, stops and restarts for minutes,
every stall past the protocol's bound reported.

One process serves the rendezvous store (a Membership that never joins a round, as the
tests' replica 0); --replicas processes train a small MLP with cgx.DiLoCo (sync_every 8,
2 fragments, 4-bit, overlap 1) over a cgx.elastic.Membership with the settings a real
run would use (--heartbeat, --last-call, --roll-call, --group-timeout); --hogs processes
spin on the CPU beside them. Every --every seconds the controller picks a replica and
either kills it (SIGKILL; restarted --down seconds later: a new replica joins), or stops
it (SIGSTOP for --stop seconds, then SIGCONT: it was dropped, or went on). After
--minutes, every stopped replica is continued, the replicas agree on an end step and
close (which ends the run), and the report is printed:

- each replica's longest gap between torch's heartbeats while it was neither stopped nor
  re-forming (torch's join beats for it then), against the bound that drops a live
  member (3 missed heartbeats);
- every stall of a replica's training (two inner steps further apart than the bound of a
  re-form: group_timeout + roll_call + 3 heartbeats + last call + 2 s of rendezvous
  skew, plus a sync's own time), with what happened around it;
- the rounds, losses and joins each replica saw, and whether the replicas alive at the end
  hold bit-identical global weights.

    python -P benchmarks/elastic_chaos.py --minutes 10 --hogs 4 [--out DIR]

With --at STATE --action ACTION it is an adversary aimed at one state of the protocol
(docs/diloco.md): each event arms a trap in the chosen replica instead of striking at a
random moment, and the replica strikes itself the next time it enters STATE, in the
middle of the protocol's work: `kill` (SIGKILL), `stop` (SIGSTOP; continued --stop
seconds later) or `delay` (its training thread sleeps --delay seconds there; its
heartbeats go on). The states: `syncing` (a sync's completion: the agreement checked,
the collective waited for), `forming` (a round formed by torch's rendezvous: the first, a
re-form after a failure or the move to the round that admits joiners), `forming-beside`
(the start of the round that admits joiners, formed beside training), `admitting` (the
admission's checks of terms and secrets in a round that formed), `sending-state` (a
member sending the run's state to joiners) and `leaving` (DiLoCo.close(), armed at the
end step for one replica). The four states between `forming` and `sending-state` come
with a change of members: at each event, with every replica up and in the run, a
second replica is killed beside the armed one, so that the others re-form and admit it
when it restarts.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here

from launch import free_port  # noqa: E402

MISSED_HEARTBEATS = 3  # torch's rendezvous drops a member that missed this many


def _settings(args) -> dict:
    return {"heartbeat": args.heartbeat, "last_call": args.last_call, "roll_call": args.roll_call,
            "group_timeout": args.group_timeout}


def _membership(port: int, run_id: str, is_host: bool, settings: dict):
    import cgx

    seconds = datetime.timedelta
    return cgx.elastic.Membership(
        f"127.0.0.1:{port}", run_id, is_host=is_host, min_replicas=1,
        heartbeat=seconds(seconds=settings["heartbeat"]), last_call=seconds(seconds=settings["last_call"]),
        roll_call=seconds(seconds=settings["roll_call"]), group_timeout=seconds(seconds=settings["group_timeout"]))


def host_main(port: int, run_id: str, settings: dict, out: str) -> None:
    """Serves the rendezvous store until the controller says the run is over."""
    import torch.distributed as dist

    membership = _membership(port, run_id, True, settings)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(hours=2))
    store.wait(["chaos/over"])
    del membership


STATES = ("syncing", "forming", "forming-beside", "admitting", "sending-state", "leaving")
ACTIONS = ("kill", "stop", "delay")
PROVOKED = ("forming", "forming-beside", "admitting", "sending-state")  # states a change of members brings


def _set_traps(slot: int, out: str, delay: float, note) -> None:
    """Where the controller armed a trap for this replica (a file trap-SLOT holding "STATE
    ACTION"), the replica strikes itself when it next enters STATE."""
    import cgx
    import cgx.diloco.replicas
    import cgx.diloco.syncs
    import cgx.elastic.membership

    trap = os.path.join(out, f"trap-{slot}")

    def enter(state: str) -> None:
        try:
            with open(trap) as f:
                armed, action = f.read().split()
        except (OSError, ValueError):
            return
        if armed != state:
            return
        os.remove(trap)
        note("trap", state=state, action=action)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            open(os.path.join(out, f"stopped-{slot}"), "w").close()  # the controller continues it
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(delay)

    def trapped(owner, name: str, state: str) -> None:
        original = getattr(owner, name)

        def entering(*args, **kwargs):
            enter(state)
            return original(*args, **kwargs)
        setattr(owner, name, entering)
    trapped(cgx.diloco.syncs.Sync, "finish", "syncing")
    trapped(cgx.elastic.membership.Membership, "next_round", "forming")
    trapped(cgx.elastic.membership.Membership, "prepare_next_round", "forming-beside")
    trapped(cgx.elastic.membership, "admit", "admitting")
    trapped(cgx.diloco.replicas.Replicas, "send", "sending-state")
    trapped(cgx.DiLoCo, "close", "leaving")


def replica_main(slot: int, incarnation: int, port: int, run_id: str, settings: dict, out: str,
                 delay: float) -> None:
    """Trains until the controller's end step; logs every heartbeat, step, round and error."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    import cgx

    torch.set_num_threads(1)
    log = open(os.path.join(out, f"replica-{slot}-{incarnation}.jsonl"), "a", buffering=1)

    def note(kind: str, **fields) -> None:
        log.write(json.dumps({"t": time.monotonic(), "kind": kind, **fields}) + "\n")
    _set_traps(slot, out, delay, note)

    keep_alive = dynamic_rendezvous.DynamicRendezvousHandler._keep_alive

    def timed_keep_alive(handler) -> None:
        note("beat")
        keep_alive(handler)
    dynamic_rendezvous.DynamicRendezvousHandler._keep_alive = timed_keep_alive
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(hours=2))
    torch.manual_seed(slot * 1000 + incarnation)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    membership = _membership(port, run_id, False, settings)
    note("start", pid=os.getpid())
    try:
        diloco = cgx.DiLoCo(model, inner, sync_every=8, fragments=2, bits=4, overlap=1, membership=membership)
        note("joined", step=diloco.step)
        generator = torch.Generator().manual_seed(slot)
        end = None
        while True:
            # Read before each step: a replica that joins at the end step closes there.
            if end is None and store.check(["chaos/end"]):
                end = int(store.get("chaos/end"))
            if end is not None and diloco.step >= end:
                break
            x = torch.randn(256, 64, generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, :10].argmax(dim=1)))
            loss.backward()
            inner.step()
            inner.zero_grad()
            stats = diloco.stats()
            note("step", step=diloco.step, replicas=stats["replicas"], rounds=stats["rounds"])
        diloco.close()
        globals_ = diloco.state_dict()["global_weights"]
        digest = hashlib.blake2b(digest_size=12)
        for name in sorted(globals_):
            digest.update(globals_[name].numpy().tobytes())
        note("end", step=diloco.step, digest=digest.hexdigest(), stats=dict(diloco.stats()))
    except cgx.MembershipError as e:  # came back after the run ended, or found no round
        note("membership-error", error=str(e))
    except Exception as e:
        note("error", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        membership.close()
        store.add("chaos/finished", 1)


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), *args])


def controller(args) -> dict:
    import torch.distributed as dist

    out = args.out or tempfile.mkdtemp(prefix="cgx-chaos-")
    os.makedirs(out, exist_ok=True)
    port, run_id = free_port(), f"chaos-{os.getpid()}"
    settings = json.dumps(_settings(args))
    rng = random.Random(args.seed)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    host = _spawn(["--role", "host", "--port", str(port), "--run-id", run_id, "--settings", settings, "--out", out])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(minutes=5))
    incarnations = [0] * args.replicas

    def start(slot: int) -> subprocess.Popen:
        return _spawn(["--role", "replica", "--slot", str(slot), "--incarnation", str(incarnations[slot]),
                       "--port", str(port), "--run-id", run_id, "--settings", settings, "--out", out,
                       "--delay", str(args.delay)])

    def arm(slot: int, state: str) -> None:
        with open(os.path.join(out, f"trap-{slot}.new"), "w") as f:
            f.write(f"{state} {args.action}")
        os.replace(os.path.join(out, f"trap-{slot}.new"), os.path.join(out, f"trap-{slot}"))
        events.append((time.monotonic(), f"arm {state} {args.action}", slot))

    def joined(slot: int) -> bool:
        """Whether the slot's running incarnation has joined the run (holds its state)."""
        name = os.path.join(out, f"replica-{slot}-{incarnations[slot]}.jsonl")
        try:
            with open(name) as f:
                return any(json.loads(line)["kind"] == "joined" for line in f if line.strip())
        except (OSError, ValueError):
            return False

    def kill(slot: int) -> None:
        replicas[slot].kill()
        replicas[slot].wait()
        down[slot] = time.monotonic() + args.down
        events.append((time.monotonic(), "kill", slot))
    replicas = [start(slot) for slot in range(args.replicas)]
    events = []  # (time, what, slot)
    stopped: dict[int, float] = {}  # slot -> when it continues
    down: dict[int, float] = {}  # slot -> when it restarts
    started = time.monotonic()
    next_event = started + args.every

    def tend(now: float) -> None:
        """Continues the stopped replicas whose time is up; notes the traps that struck."""
        for slot, when in list(stopped.items()):
            if now >= when:
                replicas[slot].send_signal(signal.SIGCONT)
                events.append((time.monotonic(), "continue", slot))
                del stopped[slot]
        for slot in range(args.replicas):
            if os.path.exists(os.path.join(out, f"stopped-{slot}")):
                os.remove(os.path.join(out, f"stopped-{slot}"))
                stopped[slot] = now + args.stop
                events.append((time.monotonic(), "stop", slot))
            elif args.at and slot not in down and slot not in killed and replicas[slot].poll() == -signal.SIGKILL:
                down[slot] = now + args.down
                events.append((time.monotonic(), "kill", slot))
    killed: set[int] = set()  # the end's: not restarted
    try:
        while time.monotonic() < started + args.minutes * 60:
            now = time.monotonic()
            tend(now)
            for slot, when in list(down.items()):
                if now >= when:
                    incarnations[slot] += 1
                    replicas[slot] = start(slot)
                    events.append((time.monotonic(), "restart", slot))
                    del down[slot]
            if now >= next_event:
                next_event = now + args.every
                live = [s for s in range(args.replicas) if s not in stopped and s not in down]
                armed = [s for s in live if os.path.exists(os.path.join(out, f"trap-{s}"))]
                if args.at in PROVOKED and len(live) == args.replicas > 2 and all(map(joined, live)):
                    # Those states come with a change of members: a second replica is
                    # killed, so that the others re-form and then admit it. Only with
                    # every replica in the run: killing the armed one too while the third
                    # has not taken the state yet would lose the run's state (a
                    # MembershipError after join_timeout, by design), not test a state.
                    victim, provoker = rng.sample(live, 2)
                    if not armed:
                        arm(victim, args.at)
                    kill(provoker)
                elif args.at == "syncing" and len(live) > 1 and not armed:
                    arm(rng.choice(live), args.at)
                elif not args.at and len(live) > 1:  # one replica always trains on
                    slot = rng.choice(live)
                    if rng.random() < 0.5:
                        kill(slot)
                    else:
                        replicas[slot].send_signal(signal.SIGSTOP)
                        stopped[slot] = now + args.stop
                        events.append((time.monotonic(), "stop", slot))
            time.sleep(0.1)
        for slot in stopped:
            replicas[slot].send_signal(signal.SIGCONT)
            events.append((time.monotonic(), "continue", slot))
        for slot in down:
            incarnations[slot] += 1
            replicas[slot] = start(slot)
            events.append((time.monotonic(), "restart", slot))
        # The end: a step every replica is still short of when it reads it (closing past
        # it, one step apart, is the user's error close() reports): 10 s of the fastest
        # replica's steps past the furthest logged step, whole sync intervals.
        steps = [(r["t"], r["step"]) for r in _records(out) if r["kind"] == "step"]
        furthest = max((step for _, step in steps), default=0)
        recent = [step for t, step in steps if t >= time.monotonic() - 5]
        rate = (max(recent) - min(recent)) / 5 if recent else 0
        margin = 16 + 8 * int(rate * 10 / 8)
        if args.at == "leaving":
            arm(rng.randrange(args.replicas), "leaving")
        store.set("chaos/end", str(furthest + margin))
        events.append((time.monotonic(), "end", -1))
        deadline = time.monotonic() + args.group_timeout * 4 + 600
        while any(p.poll() is None for p in replicas) and time.monotonic() < deadline:
            tend(time.monotonic())
            killed.update(down)  # struck at the end: not restarted
            down.clear()
            time.sleep(0.1)
    finally:
        store.set("chaos/over", "1")
        for process in hogs + replicas:
            if process.poll() is None:
                process.kill()
        host.wait(timeout=60)
    return _report(out, events, args, started)


def _records(out: str, prefix: str = "replica-") -> list[dict]:
    records = []
    for name in sorted(os.listdir(out)):
        if name.startswith(prefix) and name.endswith(".jsonl"):
            slot, incarnation = (int(v) for v in name[len(prefix):-len(".jsonl")].split("-"))
            with open(os.path.join(out, name)) as f:
                records += [{**json.loads(line), "slot": slot, "incarnation": incarnation} for line in f if line.strip()]
    return records


def _report(out: str, events: list, args, started: float) -> dict:
    records = _records(out)
    stops = [(t, slot) for t, what, slot in events if what == "stop"]
    continues = [(t, slot) for t, what, slot in events if what == "continue"]
    kills = [(t, slot) for t, what, slot in events if what == "kill"]
    ends = [t for t, what, _ in events if what == "end"]

    def stopped_during(slot: int, a: float, b: float) -> bool:
        for t, s in stops:
            resumed = min([c for c, cs in continues if cs == s and c >= t], default=float("inf"))
            if s == slot and t < b and resumed > a:
                return True
        return False
    beat_bound = MISSED_HEARTBEATS * args.heartbeat
    stall_bound = args.group_timeout + args.roll_call + MISSED_HEARTBEATS * args.heartbeat + args.last_call + 2 + 5
    lives = sorted({(r["slot"], r["incarnation"]) for r in records})
    report = {"settings": _settings(args), "hogs": args.hogs, "minutes": args.minutes, "replicas": args.replicas,
              "started": started,
              "events": [(round(t - started, 1), what, slot) for t, what, slot in events],
              "beat_bound_s": beat_bound, "stall_bound_s": stall_bound, "lives": [], "stalls": [], "beat_gaps": []}
    for slot, incarnation in lives:
        mine = [r for r in records if (r["slot"], r["incarnation"]) == (slot, incarnation)]
        beats = [r["t"] for r in mine if r["kind"] == "beat"]
        steps = [(r["t"], r["step"]) for r in mine if r["kind"] == "step"]
        rounds = [(r["t"], r["rounds"]) for r in mine if r["kind"] == "step"]

        def re_formed_during(a: float, b: float) -> bool:  # torch's join beats for it meanwhile
            # The rounds of the last step before the gap and of the first after it: a
            # re-form may hold up training for the whole gap, with no step inside it.
            before = [n for t, n in rounds if t <= a][-1:]
            after = [n for t, n in rounds if t >= b][:1]
            return len(set(before + after + [n for t, n in rounds if a <= t <= b])) > 1
        gaps = [(b - a, a) for a, b in zip(beats, beats[1:])
                if not stopped_during(slot, a, b) and not re_formed_during(a, b)]
        longest = max(gaps, default=(0.0, 0.0))
        for gap, at in gaps:
            if gap > beat_bound:
                report["beat_gaps"].append({"slot": slot, "incarnation": incarnation, "gap_s": round(gap, 2),
                                            "at_s": round(at - started, 1)})
        for (a, step_a), (b, _) in zip(steps, steps[1:]):
            if b - a > stall_bound and not stopped_during(slot, a, b) and not any(a <= t <= b for t in ends):
                near = [(round(t - started, 1), what, s) for t, what, s in events if a - stall_bound <= t <= b]
                report["stalls"].append({"slot": slot, "incarnation": incarnation, "after_step": step_a,
                                         "stall_s": round(b - a, 1), "at_s": round(a - started, 1), "events": near})
        last = next((r for r in reversed(mine) if r["kind"] in ("end", "membership-error", "error")), None)
        report["lives"].append({"slot": slot, "incarnation": incarnation, "beats": len(beats),
                                "longest_beat_gap_s": round(longest[0], 2), "steps": len(steps),
                                "first_step": steps[0][1] if steps else None,
                                "last": None if last is None else {k: last[k] for k in last if k in
                                                                   ("kind", "step", "digest", "error", "stats")}})
    digests = {life["last"]["digest"] for life in report["lives"] if life["last"] and life["last"]["kind"] == "end"}
    report["identical_at_end"] = len(digests) == 1
    report["ended"] = sum(1 for life in report["lives"] if life["last"] and life["last"]["kind"] == "end")
    report["errors"] = [life["last"]["error"] for life in report["lives"] if life["last"] and life["last"]["kind"] == "error"]
    report["kills"], report["stops"] = len(kills), len(stops)
    report["traps"] = [{"slot": r["slot"], "incarnation": r["incarnation"], "state": r["state"],
                        "action": r["action"], "at_s": round(r["t"] - started, 1)}
                       for r in records if r["kind"] == "trap"]
    with open(os.path.join(out, "chaos.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("controller", "host", "replica"), default="controller")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=4)
    parser.add_argument("--every", type=float, default=20, help="seconds between two chaos events")
    parser.add_argument("--down", type=float, default=5, help="seconds a killed replica stays down")
    parser.add_argument("--stop", type=float, default=15, help="seconds a stopped replica stays stopped")
    parser.add_argument("--heartbeat", type=int, default=5)
    parser.add_argument("--last-call", type=int, default=1)
    parser.add_argument("--roll-call", type=float, default=2)
    parser.add_argument("--group-timeout", type=int, default=30)
    parser.add_argument("--at", choices=STATES, help="aim each event at this state of the protocol")
    parser.add_argument("--action", choices=ACTIONS, default="kill", help="what an event does, with --at")
    parser.add_argument("--delay", type=float, default=10, help="seconds a delay holds the training thread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--slot", type=int)
    parser.add_argument("--incarnation", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--run-id")
    parser.add_argument("--settings")
    args = parser.parse_args()
    if args.role == "host":
        host_main(args.port, args.run_id, json.loads(args.settings), args.out)
    elif args.role == "replica":
        replica_main(args.slot, args.incarnation, args.port, args.run_id, json.loads(args.settings), args.out,
                     args.delay)
    else:
        report = controller(args)
        print(json.dumps({k: v for k, v in report.items() if k != "events"}, indent=1))
        print(f"{len(report['traps'])} traps struck; "
              f"{report['kills']} kills, {report['stops']} stops; {len(report['stalls'])} stalls past "
              f"{report['stall_bound_s']} s; {len(report['beat_gaps'])} heartbeat gaps past {report['beat_bound_s']} s; "
              f"{report['ended']} replicas ended, identical: {report['identical_at_end']}; "
              f"{len(report['errors'])} failed with another error")


if __name__ == "__main__":
    main()
