"""Emulated hosts on one machine: network namespaces joined by a bridge, each link shaped.

Compression pays only where the link is slow, so benchmarks and tests run ranks in
separate network namespaces ("hosts") whose links to a bridge in the root namespace are
limited with tbf in both directions (tbf shapes egress only, so both ends of each veth
get one). Traffic between hosts really crosses the shaped links, and the bytes that did
are read from the interface counters. Why this setup: the development VMs offer only the
tbf, htb and pfifo qdiscs (no netem, so bandwidth is limited but latency and loss are
not emulated); shaping `lo` instead would put both directions, and the TCPStore's
traffic, in one bucket; and namespaces still share /dev/shm and the hostname, so each
emulated host is given its own CGX_HOSTNAME or its traffic skips the link.

    with EmulatedHosts(2, rate="1gbit") as hosts:
        procs = [hosts.popen(i, [sys.executable, "worker.py"], env) for i in range(2)]
        ...
        sent = hosts.bytes_sent()          # per host, since creation

Needs root (CAP_NET_ADMIN) and iproute2; `EmulationUnavailable` says why otherwise.
Everything created is removed on exit, on an exception and on SIGTERM / Ctrl-C; what a
killed earlier run left behind (its process is gone) is removed at the next start.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import Sequence

__all__ = ["EmulatedHosts", "EmulationUnavailable", "available", "parse_rate"]

_PREFIX = "cgxemu"  # namespaces: cgxemu-<pid>-h<i>
_SUBNET = "10.237.0"  # private addresses that exist only inside our namespaces


class EmulationUnavailable(RuntimeError):
    """This machine or user cannot create network namespaces and shaped links."""


def parse_rate(rate: str | None) -> int | None:
    """'1gbit' / '10gbit' / '500mbit' -> bits per second; None or 'unshaped' -> None."""
    if rate is None or rate == "unshaped":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"link rate {rate!r}: expected e.g. '1gbit', '10gbit', '500mbit' or 'unshaped'")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


# Bytes a retransmitted TCP segment can add on the wire (MSS 1448 + headers), for checks
# that bound what crossed a link by payload + headers + retransmissions.
RETRANSMIT_BYTES = 1600


def link_counters(link: str = "eth0") -> tuple[int, int]:
    """(bytes sent on `link`, TCP segments retransmitted) in the calling process's network
    namespace (read from inside an emulated host). Under load a veth can drop packets, and
    TCP's retransmissions then add to what the link carries."""
    with open(f"/sys/class/net/{link}/statistics/tx_bytes") as f:
        tx = int(f.read())
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    retransmitted = int(rows[1][rows[0].index("RetransSegs")])
    return tx, retransmitted


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when emulation works here, else the reason it does not."""
    if os.geteuid() != 0:
        return "network emulation needs root (CAP_NET_ADMIN) to create namespaces and qdiscs"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network emulation needs iproute2 ('{tool}' not found: apt-get install iproute2)"
    probe = f"{_PREFIX}-probe-{os.getpid()}"
    result = _run("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Removes namespaces and bridges of earlier runs whose process no longer exists."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for name in listed:
        match = re.fullmatch(rf"{_PREFIX}-(\d+)-h\d+", name)
        if match and not _pid_alive(int(match.group(1))):
            _run("ip", "netns", "del", name, check=False)
    links = _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout
    for match in re.finditer(r"^\d+: (cgxb(\d+)):", links, re.M):
        if not _pid_alive(int(match.group(2))):
            _run("ip", "link", "del", match.group(1), check=False)


def _tbf(rate_bps: int) -> list[str]:
    # The bucket must hold a GSO segment (64 KiB) and about a millisecond of traffic, or
    # tbf throttles below its rate at 10 Gbit/s (measured; see the network notes).
    burst = max(128 * 1024, rate_bps // 8 // 1000)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "50ms"]


class EmulatedHosts:
    """`count` hosts (network namespaces) on one bridge, each link shaped to `rate`
    ('1gbit', '10gbit', ... or None / 'unshaped') in both directions."""

    def __init__(self, count: int, rate: str | None = None):
        if count < 1:
            raise ValueError(f"EmulatedHosts needs at least one host, got {count}")
        self.count = count
        self.rate_bps = parse_rate(rate)
        pid = os.getpid()
        self.bridge = f"cgxb{pid}"
        self.namespaces = [f"{_PREFIX}-{pid}-h{i}" for i in range(count)]
        # Root-side ends of the veths (names are limited to 15 characters).
        self.links = [f"cgxv{pid}h{i}" for i in range(count)]
        self._created = False
        self._old_handlers: dict[int, object] = {}

    # -- life cycle -------------------------------------------------------------------

    def __enter__(self) -> "EmulatedHosts":
        reason = available()
        if reason is not None:
            raise EmulationUnavailable(reason)
        _remove_stale()
        self._install_signal_handlers()
        self._created = True
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i, (ns, link) in enumerate(zip(self.namespaces, self.links)):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", link, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self.set_rate(None if self.rate_bps is None else f"{self.rate_bps}bit")

    def set_rate(self, rate: str | None) -> None:
        """Re-shapes every link (both directions) without recreating the hosts."""
        self.rate_bps = parse_rate(rate)
        for ns, link in zip(self.namespaces, self.links):
            for prefix in ([], ["-n", ns]):
                dev = link if not prefix else "eth0"
                if self.rate_bps is None:
                    _run("tc", *prefix, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _run("tc", *prefix, "qdisc", "replace", "dev", dev, "root", *_tbf(self.rate_bps))

    def close(self) -> None:
        """Removes what was created (idempotent)."""
        if not self._created:
            return
        self._created = False
        for ns, link in zip(self.namespaces, self.links):
            _run("ip", "link", "del", link, check=False)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        # SIGTERM would end the process without running `finally`: turn it into an
        # exception that unwinds through __exit__. Ctrl-C already raises KeyboardInterrupt.
        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, on_term)
            except ValueError:  # not the main thread: leave handlers alone
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- use ----------------------------------------------------------------------------

    def address(self, host: int) -> str:
        return f"{_SUBNET}.{host + 1}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), env=env, **kwargs)

    def bytes_sent(self) -> list[int]:
        """Bytes each host has sent over its link (its root-side veth received them),
        Ethernet/IP/TCP headers included."""
        return [self._counter(link, "rx_bytes") for link in self.links]

    def bytes_received(self) -> list[int]:
        return [self._counter(link, "tx_bytes") for link in self.links]

    @staticmethod
    def _counter(link: str, name: str) -> int:
        with open(f"/sys/class/net/{link}/statistics/{name}") as f:
            return int(f.read())


if __name__ == "__main__":
    reason = available()
    print("network emulation available" if reason is None else f"unavailable: {reason}")
