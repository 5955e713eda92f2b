"""The CGX_* table: strict parsing, clear errors, and settings that reach the backend."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import cgx
from cgx.backend import to_settings
from cgx.config import VARIABLES, from_env, markdown_table
from harness import SHM_NAME_TAG, RankError, init_cgx, run_ranks, values


def test_defaults_follow_torch_cgx():
    config = from_env({})
    assert (config.bits, config.bucket_size, config.minimal_size) == (32, 512, 16)
    assert config.inner_communicator == "SHM" and config.inner_reduction == "SRA"
    assert not config.compression_enabled


@pytest.mark.parametrize(
    "variable, text, field, value",
    [
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "4", "bits", 4),
        ("CGX_COMPRESSION_BUCKET_SIZE", "1024", "bucket_size", 1024),
        ("CGX_COMPRESSION_MINIMAL_SIZE", "0", "minimal_size", 0),
        ("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "yes", "skip_incomplete_buckets", True),
        ("CGX_COMPRESSION_STOCHASTIC_ROUNDING", "On", "stochastic_rounding", True),
        ("CGX_COMPRESSION_SEED", "123", "seed", 123),
        ("CGX_INNER_COMMUNICATOR_TYPE", "gloo", "inner_communicator", "GLOO"),
        ("CGX_INNER_COMMUNICATOR_TYPE", "mpi", "inner_communicator", "MPI"),
        ("CGX_CROSS_COMMUNICATOR_TYPE", "Mpi", "cross_communicator", "MPI"),
        ("CGX_CROSS_REDUCTION_TYPE", "ring", "cross_reduction", "Ring"),
        ("CGX_INTRA_BROADCAST", "yes", "intra_broadcast", True),
        ("CGX_INTRA_COMPRESS", "off", "intra_compress", False),
        ("CGX_INNER_REDUCTION_TYPE", "RING", "inner_reduction", "Ring"),
        ("CGX_HOSTNAME", "node7", "hostname", "node7"),
        ("CGX_SHM_RING_BYTES", "65536", "shm_ring_bytes", 65536),
        ("CGX_SHM_NAME_TAG", "job_7-b", "shm_name_tag", "job_7-b"),
        ("CGX_DEBUG_DEFERRED_EXECUTION", "on", "deferred_execution", True),
        ("CGX_PIPELINE_PIECE_VALUES", "0", "piece_values", 0),
        ("CGX_PIPELINE_PIECE_VALUES", "65536", "piece_values", 65536),
        ("CGX_CODEC_THREADS", "0", "codec_threads", 0),
        ("CGX_CODEC_THREADS", "8", "codec_threads", 8),
    ],
)
def test_parses_each_variable(variable, text, field, value):
    assert getattr(from_env({variable: text}), field) == value


@pytest.mark.parametrize(
    "variable, text",
    [
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "12abc"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "9"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", ""),
        ("CGX_COMPRESSION_BUCKET_SIZE", "0"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "9223372036854775807"),
        ("CGX_COMPRESSION_MINIMAL_SIZE", "-1"),
        ("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "2"),
        ("CGX_INNER_COMMUNICATOR_TYPE", "NCCL"),
        ("CGX_CROSS_COMMUNICATOR_TYPE", "SHM"),
        ("CGX_INNER_REDUCTION_TYPE", "tree"),
        ("CGX_CROSS_REDUCTION_TYPE", "tree"),
        ("CGX_INTRA_BROADCAST", "maybe"),
        ("CGX_INTRA_COMPRESS", "2"),
        ("CGX_HOSTNAME", "  "),
        ("CGX_HOSTNAME", " node7"),
        ("CGX_SHM_RING_BYTES", "1k"),
        ("CGX_SHM_NAME_TAG", ""),
        ("CGX_SHM_NAME_TAG", "a/b"),
        ("CGX_SHM_NAME_TAG", "a" * 33),
        ("CGX_PIPELINE_PIECE_VALUES", "-1"),
        ("CGX_PIPELINE_PIECE_VALUES", "2147483648"),
        ("CGX_CODEC_THREADS", "-1"),
        ("CGX_CODEC_THREADS", "1025"),
        # Strict: nothing around the value, ASCII digits only.
        ("CGX_COMPRESSION_QUANTIZATION_BITS", " 8 "),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "\u0664"),  # Arabic-Indic digit four
        ("CGX_COMPRESSION_BUCKET_SIZE", "\uff15\uff11\uff12"),  # full-width 512
        ("CGX_INTRA_BROADCAST", "yes "),
        ("CGX_INNER_REDUCTION_TYPE", " SRA"),
    ],
)
def test_bad_values_name_the_variable_and_what_it_accepts(variable, text):
    var = next(v for v in VARIABLES if v.name == variable)
    with pytest.raises(ValueError) as info:
        from_env({variable: text})
    assert variable in str(info.value) and var.accepted in str(info.value)


def test_config_in_python_is_checked_like_the_environment():
    with pytest.raises(ValueError, match="bits"):
        cgx.Config(bits=0)
    with pytest.raises(ValueError, match="inner_reduction"):
        cgx.Config(inner_reduction="tree")
    assert cgx.Config(inner_reduction="ring").inner_reduction == "Ring"


def test_every_setting_reaches_the_backend():
    config = cgx.Config(bits=3, bucket_size=77, minimal_size=5, skip_incomplete_buckets=True,
                        stochastic_rounding=True, seed=99, inner_communicator="GLOO",
                        inner_reduction="Ring", cross_reduction="Ring", intra_broadcast=True,
                        intra_compress=False, hostname="h1", shm_ring_bytes=8192, piece_values=4096,
                        codec_threads=3)
    dist.init_process_group("cgx", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10), pg_options=config)
    try:
        settings = cgx.get_backend().settings
        assert settings.bits == 3 and settings.bucket_size == 77 and settings.minimal_size == 5
        assert settings.skip_incomplete_buckets and settings.stochastic_rounding
        assert settings.seed == 99 and settings.hostname == "h1" and settings.shm_ring_bytes == 8192
        assert settings.piece_values == 4096 and settings.codec_threads == 3
        assert settings.inner_communicator == cgx._C.InnerCommunicator.GLOO
        assert settings.inner_reduction == cgx._C.ReductionAlgorithm.Ring
        assert settings.cross_reduction == cgx._C.ReductionAlgorithm.Ring
        assert settings.cross_communicator == cgx._C.CrossCommunicator.GLOO
        assert settings.intra_broadcast and not settings.intra_compress
        t = torch.randn(1000)
        expected = t.clone()
        dist.all_reduce(t)  # one rank: nothing to exchange, the values stay as they are
        assert torch.equal(t, expected)
    finally:
        dist.destroy_process_group()


def test_settings_round_trip_field_by_field():
    changed = cgx.Config(bits=3, bucket_size=1024, minimal_size=0, skip_incomplete_buckets=True,
                         stochastic_rounding=True, scheme="maxmin", seed=2**63, inner_communicator="GLOO",
                         cross_communicator="MPI", inner_reduction="Ring", cross_reduction="Ring",
                         intra_broadcast=True, intra_compress=False, hostname="x",
                         shm_ring_bytes=8192, deferred_execution=True, piece_values=0,
                         compression_auto=False, shm_name_tag="job-7", codec_threads=5)
    assert all(getattr(changed, v.field) != v.default for v in VARIABLES)
    for config in (cgx.Config(hostname="x", shm_name_tag="t", codec_threads=1), changed):
        settings = to_settings(config)
        for var in VARIABLES:
            value = getattr(settings, var.field)
            value = getattr(value, "name", value)  # the enums by name
            assert value == getattr(config, var.field), var.field
    assert to_settings(cgx.Config(hostname="x")).shm_name_tag == ""  # no tag
    # No count: what torch allows this process.
    assert to_settings(cgx.Config(hostname="x")).codec_threads == torch.get_num_threads()


def test_the_variables_table_and_the_cpp_settings_declare_the_same_fields_and_choices():
    """Fields are named in VARIABLES and in the C++ Settings (CGX_SETTINGS_FIELDS); enum
    choices only in C++. Either drifting from the other fails here, not at a user's run."""
    from cgx.backend import _ENUMS

    cpp_fields = {name for name, attr in vars(cgx._C.Settings).items() if isinstance(attr, property)}
    assert cpp_fields == {v.field for v in VARIABLES}
    by_field = {v.field: v for v in VARIABLES}
    for field, enum in _ENUMS.items():
        names = tuple(enum.__members__)
        assert by_field[field].accepted == " | ".join(names), field
        assert [by_field[field].parse(n.lower()) for n in names] == list(names), field
        assert [int(enum.__members__[n]) for n in names] == list(range(len(names))), field


def test_wrong_pg_options_type_is_rejected():
    with pytest.raises(TypeError, match="cgx.Config"):
        cgx.create_backend(None, backend_options={"bits": 4})


def test_python_m_cgx_prints_the_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    env["CGX_COMPRESSION_QUANTIZATION_BITS"] = "4"
    # From an empty folder: the source tree's cgx/ has no compiled module.
    out = subprocess.run([sys.executable, "-m", "cgx"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True)
    rows = {line.split()[0]: line.split()[1:3] for line in out.stdout.splitlines()}
    assert set(rows) == {var.name for var in VARIABLES}
    assert rows["CGX_COMPRESSION_QUANTIZATION_BITS"] == ["4", "environment"]
    assert rows["CGX_COMPRESSION_BUCKET_SIZE"] == ["512", "default"]


def test_python_m_cgx_marks_a_bad_value_and_exits_1(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    env["CGX_COMPRESSION_BUCKET_SIZE"] = "12abc"
    out = subprocess.run([sys.executable, "-m", "cgx"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert set(rows) == {var.name for var in VARIABLES}
    assert "NOT VALID: '12abc'" in rows["CGX_COMPRESSION_BUCKET_SIZE"]
    assert "CGX_COMPRESSION_BUCKET_SIZE='12abc' is not valid: expected integer in 1..2^30" in out.stderr


def test_python_m_cgx_names_a_misspelt_variable_and_exits_1_and_has_help(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    env["CGX_COMPRESION_BITS"] = "4"
    out = subprocess.run([sys.executable, "-m", "cgx"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert ("CGX_COMPRESION_BITS is not a variable cgx reads: did you mean CGX_COMPRESSION_QUANTIZATION_BITS?"
            in out.stderr)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    out = subprocess.run([sys.executable, "-m", "cgx", "--help"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m cgx") and "--markdown" in out.stdout
    out = subprocess.run([sys.executable, "-m", "cgx", "--table"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert out.returncode == 2 and "unrecognized arguments: --table" in out.stderr


def _configuration_md() -> str:
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "configuration.md")) as f:
        return f.read()


def test_docs_show_the_table_as_declared():
    """docs/configuration.md holds exactly the table the declarations give (python -m cgx
    --markdown): no row, default or accepted range can drift from the code."""
    lines = _configuration_md().splitlines()
    start = lines.index("| Variable | Default | Accepted | Meaning |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    assert "\n".join(lines[start:end]) == markdown_table()


def test_docs_name_every_config_field():
    docs = " ".join(_configuration_md().split())
    listed = re.search(r"`cgx\.Config` has one field per variable \(([^)]*)\)", docs).group(1)
    assert re.findall(r"`(\w+)`", listed) == [f.name for f in dataclasses.fields(cgx.Config)]


def test_config_fields_follow_the_table():
    fields = dataclasses.fields(cgx.Config)
    assert [(f.name, f.default) for f in fields] == [(v.field, v.default) for v in VARIABLES]
    assert cgx.Config() == from_env({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cgx.Config().bits = 4
    assert cgx.Config(bits=4).compression_enabled and not cgx.Config().compression_enabled
    assert cgx.Config(cross_communicator="mpi").uses_mpi and not cgx.Config().uses_mpi
    # The C++ Settings has exactly the table's fields (to_settings sets each one).
    names = {n for n in dir(cgx._C.Settings) if not n.startswith("_")}
    assert names == {v.field for v in VARIABLES}


def test_limits_are_the_cpp_constants():
    """Declared once, in csrc/backend/settings.h: Python takes them from cgx._C."""
    import cgx.config
    import cgx.layers

    for name in ("RAW_BITS", "MAX_BITS", "MAX_BUCKET_SIZE", "MAX_MINIMAL_SIZE",
                 "MIN_SHM_RING_BYTES", "MAX_SHM_RING_BYTES"):
        assert getattr(cgx.config, name) is getattr(cgx._C, name), name
    assert cgx.layers.RAW_BITS is cgx._C.RAW_BITS
    assert cgx.layers.MAX_BITS is cgx._C.MAX_BITS
    assert cgx.layers.MAX_BUCKET_SIZE is cgx._C.MAX_BUCKET_SIZE
    # The values the docs state.
    assert (cgx._C.RAW_BITS, cgx._C.MAX_BITS, cgx._C.MAX_BUCKET_SIZE, cgx._C.MAX_MINIMAL_SIZE,
            cgx._C.MIN_SHM_RING_BYTES, cgx._C.MAX_SHM_RING_BYTES) == (
                32, 8, 2**30, 2**62, 4096, 2**36)


# (field, the last value accepted, the first refused past it)
_EDGES = [
    ("bits", 1, 0),
    ("bits", cgx._C.MAX_BITS, cgx._C.MAX_BITS + 1),
    ("bits", cgx._C.RAW_BITS, cgx._C.RAW_BITS - 1),
    ("bits", cgx._C.RAW_BITS, cgx._C.RAW_BITS + 1),
    ("bucket_size", 1, 0),
    ("bucket_size", cgx._C.MAX_BUCKET_SIZE, cgx._C.MAX_BUCKET_SIZE + 1),
    ("minimal_size", 0, -1),
    ("minimal_size", cgx._C.MAX_MINIMAL_SIZE, cgx._C.MAX_MINIMAL_SIZE + 1),
    ("shm_ring_bytes", cgx._C.MIN_SHM_RING_BYTES, cgx._C.MIN_SHM_RING_BYTES - 1),
    ("shm_ring_bytes", cgx._C.MAX_SHM_RING_BYTES, cgx._C.MAX_SHM_RING_BYTES + 1),
]


@pytest.mark.parametrize("field, last, refused", _EDGES)
def test_out_of_range_raises_naming_the_variable(field, last, refused):
    var = next(v for v in VARIABLES if v.field == field)
    assert getattr(cgx.Config(**{field: last}), field) == last
    assert getattr(from_env({var.name: str(last)}), field) == last
    with pytest.raises(ValueError) as info:
        cgx.Config(**{field: refused})
    assert f"cgx.Config.{field}={refused!r}" in str(info.value) and var.name in str(info.value)
    assert var.accepted in str(info.value)
    with pytest.raises(ValueError, match=var.name):
        from_env({var.name: str(refused)})


@pytest.mark.parametrize("field, last, refused", _EDGES)
def test_the_backend_checks_the_same_limits(field, last, refused):
    """A Settings built in Python without cgx.Config meets the same limits in C++."""
    settings = to_settings(cgx.Config())
    setattr(settings, field, refused)
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=10)
    exact = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), 0, 1, timeout)
    with pytest.raises(ValueError, match=f"cgx: {field} must be in"):
        cgx._C.ProcessGroupCGX(store, 0, 1, timeout, exact, None, settings)


def test_layer_policy_checks_the_same_limits():
    from cgx.layers import check_bits, check_bucket_size

    check_bits(cgx._C.MAX_BITS, "t")
    check_bits(cgx._C.RAW_BITS, "t")
    check_bucket_size(cgx._C.MAX_BUCKET_SIZE, "t")
    with pytest.raises(ValueError, match="bits must be in 1..8, or 32"):
        check_bits(cgx._C.MAX_BITS + 1, "t")
    with pytest.raises(ValueError, match="bits must be in 1..8, got 32"):
        check_bits(cgx._C.RAW_BITS, "t", allow_raw=False)
    with pytest.raises(ValueError, match=r"bucket_size must be in 1..2\^30"):
        check_bucket_size(cgx._C.MAX_BUCKET_SIZE + 1, "t")


def test_mpi_without_an_mpi_launch_is_a_value_error(monkeypatch):
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    for kind in ("inner", "cross"):
        config = cgx.Config(**{f"{kind}_communicator": "MPI"})
        with pytest.raises(ValueError, match=f"CGX_{kind.upper()}_COMMUNICATOR_TYPE=MPI.*mpirun"):
            cgx.mpi.require(config)


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
         {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "2"}),
        ({"RANK": "0"}, None),
    ],
)
def test_mpi_launcher_variables_map_to_torch_ones(environ, expected):
    assert cgx.mpi.launch_variables(environ) == expected


def _segment_names(rank, world, config_tag):
    """The /dev/shm entries named for this group's tag as this rank announces its segment
    (they are unlinked once every local rank has opened them), and the allreduce's value."""
    tag = config_tag or os.environ["CGX_SHM_NAME_TAG"]
    seen = []

    class ListingStore(dist.Store):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def set(self, key, value):
            if "/created/" in key:  # this rank's segment exists by now
                seen.extend(n for n in os.listdir("/dev/shm") if n.startswith(f"cgx-{tag}-"))
            self.inner.set(key, value)

        def get(self, key):
            return self.inner.get(key)

    construct = cgx._C.ProcessGroupCGX
    cgx._C.ProcessGroupCGX = lambda store, *args: construct(ListingStore(store), *args)
    init_cgx(rank, world, pg_options=cgx.Config(bits=4, scheme="maxmin", shm_name_tag=config_tag))
    t = torch.ones(1000)
    dist.all_reduce(t)  # over shared memory, compressed (a constant bucket is exact in maxmin)
    return sorted(seen), float(t[0])


@pytest.mark.parametrize("from_config", [False, True])
def test_shared_memory_segments_carry_the_processs_tag_or_the_configs(from_config):
    # A cgx.Config without a tag takes the process's CGX_SHM_NAME_TAG (the suite sets one).
    # Tags of this suite's own (another suite's are not this test's to see).
    tag, config_tag = f"{SHM_NAME_TAG}x", f"{SHM_NAME_TAG}c" if from_config else None
    results = values(run_ranks(_segment_names, 2, env={"CGX_SHM_NAME_TAG": tag}, args=(config_tag,)))
    for names, value in results:
        assert value == 2.0
        assert names and all(re.fullmatch(rf"cgx-{config_tag or tag}-[0-9a-f]{{32}}-[01]", n) for n in names), names


def _init_with_a_config(rank, world):
    init_cgx(rank, world, pg_options=cgx.Config(bits=4))


def test_a_bad_tag_in_the_environment_fails_init_on_every_rank_also_with_a_config():
    for r in run_ranks(_init_with_a_config, 2, env={"CGX_SHM_NAME_TAG": "a/b"}):
        assert isinstance(r, RankError) and r.type == "ValueError", r
        assert "CGX_SHM_NAME_TAG='a/b'" in r.message, r.message
