"""Starts the ranks of a job as real processes, on this host or on emulated hosts.

Each rank runs `argv` with torch's env:// variables set (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE). On emulated hosts (netemu.EmulatedHosts) rank r
runs in host r // ranks_per_host, and cgx is told which ranks share a host through
CGX_HOSTNAME (the namespaces share the machine's hostname and /dev/shm), so traffic
between hosts crosses the shaped links and traffic inside a host does not. Gloo is bound
to the host's interface with GLOO_SOCKET_IFNAME.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from netemu import EmulatedHosts

__all__ = ["RankFailure", "free_port", "run_job", "run_worker", "join_worker"]


class RankFailure(RuntimeError):
    """A rank exited with an error or the job ran past its time limit."""


def free_port() -> int:
    """A port free on this machine's loopback now, chosen below the kernel's ephemeral
    range: a port the kernel hands out (bind to 0) is free only until some outgoing
    connection (another job's Gloo or store client) is given it as its local port, and a
    server started on it later then fails with EADDRINUSE (seen in CI)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    low = 10000 if ephemeral_low > 11000 else 1024
    for _ in range(100):
        port = random.randrange(low, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in [{low}, {ephemeral_low}) after 100 tries")


def run_job(argv: Sequence[str], world_size: int, *, hosts: EmulatedHosts | None = None,
            env: dict[str, str] | None = None, timeout_s: float = 600.0) -> None:
    """Runs `argv` as `world_size` ranks and waits for all of them. Without `hosts`, all
    ranks are local (loopback, one host); with it, ranks are spread evenly over its hosts.
    Raises RankFailure (after killing the others) when a rank fails or time runs out."""
    if hosts is not None and world_size % hosts.count:
        raise ValueError(f"{world_size} ranks do not spread evenly over {hosts.count} hosts")
    per_host = world_size // hosts.count if hosts is not None else world_size
    base = dict(os.environ, **(env or {}))
    base.update(
        MASTER_ADDR=hosts.address(0) if hosts else "127.0.0.1",
        # A fresh namespace has every port free; on the shared loopback ask the kernel.
        MASTER_PORT=str(29500 if hosts else free_port()),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(per_host),
        GLOO_SOCKET_IFNAME="eth0" if hosts else "lo",
    )
    procs: list[subprocess.Popen] = []
    # stderr to files, not pipes: a chatty rank must not block on a full pipe.
    logs = [tempfile.TemporaryFile("w+") for _ in range(world_size)]
    try:
        for rank in range(world_size):
            host = rank // per_host
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % per_host))
            if hosts is not None:
                rank_env["CGX_HOSTNAME"] = f"emulated-host-{host}"
                procs.append(hosts.popen(host, argv, rank_env, stderr=logs[rank]))
            else:
                procs.append(subprocess.Popen(argv, env=rank_env, stderr=logs[rank]))
        _wait_all(procs, logs, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()


def run_worker(script: str, cfg: dict, world_size: int, rate: str, *, ranks_per_host: int = 1,
               timeout_s: float = 600.0) -> list:
    """Runs `script --worker CONFIG` as `world_size` ranks: all on this host for rate
    "loopback", else `ranks_per_host` per emulated host behind links of `rate`. CONFIG is
    `cfg` plus "out", the file the ranks write their rows to (JSON); returns the rows."""
    with tempfile.TemporaryDirectory(prefix="cgx-bench-") as tmp:
        cfg = dict(cfg, out=os.path.join(tmp, "rows.json"))
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        argv = [sys.executable, "-P", os.path.abspath(script), "--worker", cfg_path]
        if rate == "loopback":
            run_job(argv, world_size, timeout_s=timeout_s)
        else:
            with EmulatedHosts(world_size // ranks_per_host, rate=rate) as hosts:
                run_job(argv, world_size, hosts=hosts, timeout_s=timeout_s)
        with open(cfg["out"]) as f:
            return json.load(f)


def join_worker(config_path: str) -> dict:
    """The rank side of run_worker: one thread for torch ops (ranks share the cores), the
    job's default Gloo group joined over env://; returns the config."""
    import datetime

    import torch
    import torch.distributed as dist

    with open(config_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    return cfg


def _tail(log, limit: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-limit:]


def _wait_all(procs: list[subprocess.Popen], logs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = failed[0]
            for p in procs:
                if p.poll() is None:
                    p.kill()
            raise RankFailure(f"rank {rank} exited with code {codes[rank]}:\n{_tail(logs[rank])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise RankFailure(f"ranks still running after {timeout_s:.0f} s; rank 0 said:\n"
                              f"{_tail(logs[0])}")
        time.sleep(0.05)
