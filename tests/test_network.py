"""The allreduce benchmark harness, and the cross-host path over emulated links.

The benchmark runs as users run it (a subprocess that launches real ranks); the
emulated-host test puts each rank in its own network namespace so that the compressed
traffic really crosses a link, and counts the bytes on that link.
"""

import json
import os
import subprocess
import sys

import pytest

import cgx

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import netemu  # noqa: E402


def run_benchmark(tmp_path, *args):
    out = tmp_path / "allreduce.json"
    cmd = [sys.executable, "-P", os.path.join(BENCHMARKS, "allreduce.py"), "--repeats", "1",
           "--json", str(out), "--plot", str(tmp_path / "allreduce.png"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out) as f:
        return done.stdout, json.load(f)["results"]


def test_benchmark_smoke_on_loopback(tmp_path):
    stdout, results = run_benchmark(tmp_path, "--sizes-mib", "1", "--world-sizes", "2",
                                    "--rates", "loopback", "--methods", "gloo", "cgx-4-SRA")
    assert {r["method"] for r in results} == {"gloo", "cgx-4-SRA"}
    assert all(r["median_s"] > 0 and r["world_size"] == 2 for r in results)
    assert "| 2 | loopback | 1 |" in stdout
    assert (tmp_path / "allreduce.png").stat().st_size > 0


@pytest.mark.skipif(netemu.available() is not None, reason=str(netemu.available()))
def test_cross_host_bytes_on_the_wire_shrink(tmp_path):
    """Two emulated hosts: what crosses the links is the compressed payload (plus
    headers), 4 bits + one min/scale pair per 512 values: 32 / 4.125 = 7.76x fewer
    bytes than Gloo's float32 allreduce."""
    size_mib, world = 4, 2
    _, results = run_benchmark(tmp_path, "--sizes-mib", str(size_mib), "--world-sizes", str(world),
                               "--rates", "unshaped", "--methods", "gloo", "cgx-4-SRA")
    by_method = {r["method"]: r for r in results}
    gloo, ours = by_method["gloo"], by_method["cgx-4-SRA"]
    n = int(size_mib * 2**20) // 4
    # SRA: each rank sends (W-1)/W of the buffer compressed, twice.
    predicted = 2 * (world - 1) / world * cgx.compressed_size(n, 4, 512)
    for wire, payload in zip(ours["wire_bytes"], ours["payload_bytes"]):
        assert abs(payload - predicted) / predicted < 0.01, (payload, predicted)
        assert payload <= wire < payload * 1.05, (wire, payload)  # headers only on top
    ratio = sum(gloo["wire_bytes"]) / sum(ours["wire_bytes"])
    assert 7.3 < ratio < 7.9, ratio
    assert netemu._run("ip", "netns", "list").stdout.count("cgxemu-") == 0
