"""The C++ tests of the torch-free core (tests/cpp): chunking, layout codec, quantizer,
shared-memory transport. Built here with CMake, without torch or Python, and run.

The build folder is build/cpp-tests/<hash of the compiler and CMake> in the repository
(ignored by git), so a rerun rebuilds only what changed (the build takes ~16 s from
scratch on the 2-core VM, next to nothing when nothing changed); where the repository
is not writable, a temporary folder."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "cpp"


def _tool(name: str) -> str | None:
    """`name` on PATH, else the copy a pip package of that name carries (cmake, ninja)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        module = __import__(name)
    except ImportError:
        return None
    bin_dir = getattr(module, "CMAKE_BIN_DIR", None) or getattr(module, "BIN_DIR", None)
    candidate = Path(bin_dir, name) if bin_dir else None
    return str(candidate) if candidate and candidate.exists() else None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        found = name and shutil.which(name)
        if found:
            return found
    return None


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(command)} exited with {done.returncode}\n"
        f"--- stdout ---\n{done.stdout[-20000:]}\n--- stderr ---\n{done.stderr[-20000:]}"
    )
    return done


def _build_folder(compiler: str, cmake: str, tmp_path_factory) -> Path:
    """A folder of its own per compiler and CMake: CMake refuses to switch compilers in
    a configured folder."""
    key = hashlib.sha256(f"{compiler}\0{cmake}".encode()).hexdigest()[:12]
    build = SOURCE.parent.parent / "build" / "cpp-tests" / key
    try:
        build.mkdir(parents=True, exist_ok=True)
    except OSError:
        return tmp_path_factory.mktemp("cpp-tests")
    return build if os.access(build, os.W_OK) else tmp_path_factory.mktemp("cpp-tests")


@pytest.fixture(scope="session")
def core_tests(tmp_path_factory) -> Path:
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found (CXX, c++, g++, clang++)")
    cmake = _tool("cmake")
    assert cmake, "cmake is needed (on PATH, or `pip install cmake`), as for the package build"
    build = _build_folder(compiler, cmake, tmp_path_factory)
    configure = [cmake, "-S", str(SOURCE), "-B", str(build), f"-DCMAKE_CXX_COMPILER={compiler}"]
    ninja = _tool("ninja")
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    _run(configure, timeout=300)
    _run([cmake, "--build", str(build), "--parallel", str(os.cpu_count() or 2)], timeout=900)
    return build / "cgx_core_tests"


def test_cpp_core(core_tests: Path):
    # Eight shards (the binary's --shard: every 8th test), a process a core at a time (the
    # tests are single-threaded): small shards keep every core busy to the end (two shards
    # of every other test ended at 13.7 and 20.6 s on two cores).
    shards = 8
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(shards, max(2, os.cpu_count() or 2)))
    try:
        done = list(pool.map(lambda k: subprocess.run([str(core_tests), f"--shard={k}/{shards}"], capture_output=True,
                                                      text=True, timeout=300), range(shards)))
    finally:
        pool.shutdown(cancel_futures=True)  # a shard that timed out (and was killed) starts no more
    for shard in done:
        assert shard.returncode == 0 and shard.stdout.rstrip().endswith(" 0 failed"), \
            f"{shard.stdout[-20000:]}\n{shard.stderr[-20000:]}"
    ran = [int(shard.stdout.rstrip().splitlines()[-1].split()[0]) for shard in done]
    registered = sum(f.read_text().count("\nCGX_TEST(") for f in SOURCE.glob("*.cpp"))
    assert sum(ran) == registered and min(ran) > 0, (ran, registered)  # every test, in one shard
