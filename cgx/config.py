"""The one table of ``CGX_*`` environment variables.

Each variable is declared once here, with its type, default, accepted values and
meaning; :func:`from_env` parses them strictly (``"12abc"``, ``" 8"`` and Unicode
digits are errors) and raises :class:`ValueError` naming the variable and what it
accepts. ``python -m cgx`` prints the table with the values in effect;
docs/configuration.md shows it as :func:`markdown_table` writes it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import socket
from typing import Any, Callable, Mapping

# The limits and the enums' names are C++ constants, each declared once
# (csrc/backend/settings.h, collectives/phases.h, compression/quantizer.h).
from cgx._C import (MAX_BITS, MAX_BUCKET_SIZE, MAX_CODEC_THREADS, MAX_HADAMARD_BITS, MAX_HADAMARD_BUCKET,
                    MAX_MINIMAL_SIZE, MAX_PIECE_VALUES, MAX_SHM_NAME_TAG, MAX_SHM_RING_BYTES, MIN_SHM_RING_BYTES,
                    PIECE_VALUES, RAW_BITS,
                    SCHEMES, CrossCommunicator,
                    InnerCommunicator, ReductionAlgorithm)

__all__ = ["Variable", "VARIABLES", "Config", "from_env", "describe", "markdown_table", "int_range", "is_int",
           "check_int", "read"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _number(value: int) -> str:
    """``value`` as the docs write it: a power of two above 2^16 as ``2^k``."""
    if value > 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def int_range(low: int, high: int) -> str:
    """An integer range as errors and docs write it (``1..2^30``)."""
    return f"{_number(low)}..{_number(high)}"


def is_int(value: Any) -> bool:
    """An int and not a bool (True is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, name: str, what: str, low: int = 0, high: int | None = None) -> None:
    """ValueError naming `what`'s argument `name` unless `value` is an integer in low..high."""
    if not (is_int(value) and value >= low and (high is None or value <= high)):
        allowed = f">= {low}" if high is None else f"in {int_range(low, high)}"
        raise ValueError(f"{what}: {name} must be an integer {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    field: str  # attribute of Config
    default: Any
    accepted: str  # shown in errors and docs
    parse: Callable[[str], Any]  # raises ValueError with no message on a bad value
    doc: str


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]+", text):  # ASCII digits only, nothing around them
            raise ValueError
        value = int(text)
        if value < low or (high is not None and value > high):
            raise ValueError
        return value

    return parse


def _bits(text: str) -> int:
    value = _int_in(1, RAW_BITS)(text)
    if MAX_BITS < value < RAW_BITS:
        raise ValueError
    return value


def _bool(text: str) -> bool:
    word = text.lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError


def _choice(*choices: str) -> Callable[[str], str]:
    """A parser accepting `choices` in any case, returning the spelling given here."""
    by_lower = {c.lower(): c for c in choices}

    def parse(text: str) -> str:
        try:
            return by_lower[text.lower()]
        except KeyError:
            raise ValueError from None

    return parse


def _nonempty(text: str) -> str:
    if not text or text != text.strip():
        raise ValueError
    return text


def _name_tag(text: str) -> str:
    if not re.fullmatch(rf"[A-Za-z0-9_-]{{1,{MAX_SHM_NAME_TAG}}}", text):
        raise ValueError
    return text


_INNER = tuple(InnerCommunicator.__members__)
_CROSS = tuple(CrossCommunicator.__members__)
_REDUCTIONS = tuple(ReductionAlgorithm.__members__)

VARIABLES: tuple[Variable, ...] = (
    Variable("CGX_COMPRESSION_QUANTIZATION_BITS", "bits", RAW_BITS,
             f"1..{MAX_BITS}, or {RAW_BITS} (off)", _bits,
             f"Bits per value on the wire. {RAW_BITS} turns compression off: every allreduce "
             "is exact."),
    Variable("CGX_COMPRESSION_BUCKET_SIZE", "bucket_size", 512,
             f"integer in {int_range(1, MAX_BUCKET_SIZE)}", _int_in(1, MAX_BUCKET_SIZE),
             "Values per quantization bucket (each bucket sends its own min and scale)."),
    Variable("CGX_COMPRESSION_SCHEME", "scheme", "hadamard", " | ".join(SCHEMES), _choice(*SCHEMES),
             "How values become levels: hadamard (each bucket rotated, then levels placed "
             f"for a normal distribution; at 1..{MAX_HADAMARD_BITS} bits with buckets a power "
             f"of two in 8..{MAX_HADAMARD_BUCKET}, maxmin elsewhere) or maxmin (levels evenly "
             "between each bucket's min and max; the default before cgx 0.2, and the "
             "faster CPU codec). docs/wire-format.md, docs/benchmarks.md."),
    Variable("CGX_COMPRESSION_MINIMAL_SIZE", "minimal_size", 16,
             f"integer in {int_range(0, MAX_MINIMAL_SIZE)}", _int_in(0, MAX_MINIMAL_SIZE),
             "Tensors with at most this many elements are reduced exactly (uncompressed)."),
    Variable("CGX_COMPRESSION_AUTO", "compression_auto", True, "0/1, true/false, yes/no, on/off",
             _bool,
             "Compression only where it pays: per group and size class, cgx times its "
             "compressible CPU allreduces compressed and sent the exact way (unquantized, "
             "summed in float32) and sends each call the faster way, the same on every rank; the "
             "slower way is re-tried now and then. Runs are then not bit-reproducible. 0: every "
             "compressible call is compressed. cgx.stats() shows the choice per size class "
             "(docs/configuration.md)."),
    Variable("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "skip_incomplete_buckets", False,
             "0/1, true/false, yes/no, on/off", _bool,
             "Send a partial last bucket raw (float32) instead of quantizing it."),
    Variable("CGX_COMPRESSION_STOCHASTIC_ROUNDING", "stochastic_rounding", False,
             "0/1, true/false, yes/no, on/off", _bool,
             ("Round stochastically instead of to the nearest level: unbiased with maxmin; with "
              "hadamard only between its outer levels (beyond them values are clipped).")),
    Variable("CGX_COMPRESSION_SEED", "seed", 0, "integer in 0..2^64-1", _int_in(0, 2**64 - 1),
             "Seed of the stochastic-rounding streams: the same seed gives the same results "
             "(with CGX_COMPRESSION_AUTO=0: auto's choices follow timings)."),
    Variable("CGX_INNER_COMMUNICATOR_TYPE", "inner_communicator", "SHM", " | ".join(_INNER),
             _choice(*_INNER),
             "How ranks on one host exchange compressed data: POSIX shared memory, MPI "
             "(needs an mpirun launch), or the wrapped Gloo backend."),
    Variable("CGX_CROSS_COMMUNICATOR_TYPE", "cross_communicator", "GLOO", " | ".join(_CROSS),
             _choice(*_CROSS),
             "How ranks on different hosts exchange compressed data: MPI (needs an mpirun "
             "launch) or the wrapped Gloo backend."),
    Variable("CGX_INNER_REDUCTION_TYPE", "inner_reduction", "SRA", " | ".join(_REDUCTIONS),
             _choice(*_REDUCTIONS),
             "Allreduce algorithm among the ranks of one host: scatter-reduce-allgather "
             "(2 quantization stages) or ring (size stages, neighbour traffic only)."),
    Variable("CGX_CROSS_REDUCTION_TYPE", "cross_reduction", "SRA", " | ".join(_REDUCTIONS),
             _choice(*_REDUCTIONS),
             "Allreduce algorithm across hosts (also the flat one when every host has "
             "one rank)."),
    Variable("CGX_INTRA_BROADCAST", "intra_broadcast", False, "0/1, true/false, yes/no, on/off",
             _bool,
             "Hierarchical allreduce through one leader per host (reduce to it, it alone "
             "talks across hosts, then broadcasts) instead of every local rank carrying "
             "its slice across hosts."),
    Variable("CGX_INTRA_COMPRESS", "intra_compress", True, "0/1, true/false, yes/no, on/off",
             _bool,
             "Hierarchical allreduce: compress the reduction inside a host too (off: it "
             "moves float32, one quantization stage fewer with SRA; what crosses hosts, "
             "and the result shared inside a host, is always compressed)."),
    Variable("CGX_HOSTNAME", "hostname", None,
             "non-empty string, no surrounding spaces (default: the hostname)",
             _nonempty,
             "Host identity: ranks with the same value share memory. Set it to different "
             "values to force the cross-host path (tests, network namespaces)."),
    Variable("CGX_SHM_NAME_TAG", "shm_name_tag", None,
             f"1..{MAX_SHM_NAME_TAG} of A-Z a-z 0-9 _ -", _name_tag,
             "A tag in the names of the shared-memory segments of this process's groups "
             "(/dev/shm/cgx-<tag>-<random>-<rank>), so that jobs sharing a machine can tell "
             "their segments apart (a leak check, a clean-up after a crash). Each process's "
             "own (a cgx.Config without it takes this variable's value; ranks may differ): "
             "the segments of a group's ranks on one host carry the tag of the lowest of "
             "them, which names them all."),
    Variable("CGX_SHM_RING_BYTES", "shm_ring_bytes", 4 << 20,
             f"integer in {int_range(MIN_SHM_RING_BYTES, MAX_SHM_RING_BYTES)}",
             _int_in(MIN_SHM_RING_BYTES, MAX_SHM_RING_BYTES),
             "Capacity of each shared-memory ring (one per ordered pair of local ranks); "
             "larger messages stream through it."),
    Variable("CGX_PIPELINE_PIECE_VALUES", "piece_values", PIECE_VALUES,
             f"integer in {int_range(0, MAX_PIECE_VALUES)}", _int_in(0, MAX_PIECE_VALUES),
             "Values per piece of a compressed collective's pipeline: each rank's chunk "
             "travels in pieces of about this many values (at most 64), one on the wire "
             "while the next is encoded. 0: each chunk in one piece, no overlap. The flat "
             "allreduce and the sharded collectives; the hierarchical one cuts its own."),
    Variable("CGX_CODEC_THREADS", "codec_threads", 0,
             f"integer in {int_range(0, MAX_CODEC_THREADS)}", _int_in(0, MAX_CODEC_THREADS),
             "Threads a rank's CPU codec may use on one compressed collective: its buckets "
             "split over them, the same bytes for any count. 0: what torch allows the rank "
             "(torch.get_num_threads(), which torchrun makes 1 where it starts several ranks "
             "a host, so that they do not oversubscribe it)."),
    Variable("CGX_DEBUG_DEFERRED_EXECUTION", "deferred_execution", False,
             "0/1, true/false, yes/no, on/off", _bool,
             "Debugging: run the CPU codec work as a GPU stream would (queued until the "
             "algorithm synchronises, bytes garbage until then), so that ordering bugs of "
             "the CUDA path show without a GPU. The results are the same bits."),
)


def _check(self) -> None:
    # Values given in Python pass the same checks as the environment's.
    for var in VARIABLES:
        value = getattr(self, var.field)
        if value is None and var.default is None:
            continue
        try:
            parsed = var.parse(str(value))
        except ValueError:
            raise ValueError(
                f"cgx.Config.{var.field}={value!r} is not valid: expected {var.accepted} "
                f"(as {var.name})"
            ) from None
        object.__setattr__(self, var.field, parsed)


def _annotation(var: Variable) -> Any:
    # A default of None means "found at run time" (the hostname): a string otherwise.
    return str | None if var.default is None else type(var.default)


# One field per variable, in the table's order, with the table's default. Frozen; each
# value is checked (and normalised, "ring" -> "Ring") as the environment's would be.
Config = dataclasses.make_dataclass(
    "Config",
    [(v.field, _annotation(v), v.default) for v in VARIABLES],
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "A group's settings: one field per CGX_* variable (VARIABLES), e.g. "
                   "``cgx.Config(bits=4, bucket_size=1024)``; hostname None: this machine's.",
        "__post_init__": _check,
        "compression_enabled": property(lambda self: self.bits != RAW_BITS),
        "uses_mpi": property(lambda self: "MPI" in (self.inner_communicator,
                                                    self.cross_communicator)),
    },
)


def from_env(environ: Mapping[str, str] | None = None) -> Config:
    """Reads every ``CGX_*`` variable; raises ValueError naming a bad one."""
    return Config(**{var.field: read(var.field, environ) for var in VARIABLES})


def read(field: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the variable of Config field `field` in `environ` (default
    os.environ), or its default; ValueError naming the variable on a bad value."""
    environ = os.environ if environ is None else environ
    var = next(v for v in VARIABLES if v.field == field)
    text = environ.get(var.name)
    if text is None:
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        raise ValueError(_not_valid(var, text)) from None


def _not_valid(var: Variable, text: str) -> str:
    return f"{var.name}={text!r} is not valid: expected {var.accepted}"


def _closest(name: str, known: list[str]) -> str | None:
    """The known name most like `name`, word by word (a misspelt or missing word), if any is."""
    def likeness(candidate: str) -> float:
        words, theirs = name.split("_")[1:], candidate.split("_")[1:]
        matched = sum(max(difflib.SequenceMatcher(None, w, t).ratio() for t in theirs) for w in words)
        return matched / max(len(words), len(theirs))
    best = max(known, key=likeness)
    return best if likeness(best) >= 0.6 else None


def describe(environ: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """The table of variables with the value in effect and who set it, and a message for
    each value that is not valid (its row says so instead of a value) and each CGX_*
    variable set that cgx does not read."""
    environ = os.environ if environ is None else environ
    rows, problems = [], []
    for var in VARIABLES:
        text = environ.get(var.name)
        if text is None:
            value, source = var.default, "default"
        else:
            try:
                value, source = var.parse(text), "environment"
            except ValueError:
                value, source = f"NOT VALID: {text!r}", "environment"
                problems.append(_not_valid(var, text))
        if value is None and var.field == "hostname":
            value = socket.gethostname()
        elif value is None and var.field == "shm_name_tag":
            value = "none"
        rows.append((var.name, str(value), source, var.accepted))
    known = [var.name for var in VARIABLES]
    for name in sorted(n for n in environ if n.startswith("CGX_") and n not in known):
        close = _closest(name, known)
        problems.append(f"{name} is not a variable cgx reads" + (f": did you mean {close}?" if close else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return table, problems


def markdown_table() -> str:
    """The table of docs/configuration.md, from the declarations above."""
    def default(var: Variable) -> str:
        return {"hostname": "the hostname", "shm_name_tag": "none"}.get(var.field, str(var.default))

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| Variable | Default | Accepted | Meaning |", "|---|---|---|---|"]
    lines += [f"| `{v.name}` | {default(v)} | {cell(v.accepted)} | {v.doc} |" for v in VARIABLES]
    return "\n".join(lines)
