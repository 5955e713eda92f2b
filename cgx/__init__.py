"""cgx: compressed collective communication for PyTorch.

Importing cgx registers the torch.distributed backend ``"cgx"``::

    import torch, torch.distributed as dist, cgx
    dist.init_process_group(backend="cgx")      # torchrun, mp.spawn or env://
    dist.all_reduce(t)                          # compressed when CGX_COMPRESSION_QUANTIZATION_BITS < 32

Launch with torchrun, mp.spawn or mpirun (cgx.mpi reads the MPI launcher's ranks).
Configuration: the CGX_* variables in :mod:`cgx.config` (``python -m cgx`` lists them).
"""

import importlib

import torch  # noqa: F401  (loads libtorch before the extension: the module has no RUNPATH)
import torch.distributed  # noqa: F401  (registers the c10d base classes the module derives from)

from cgx import _C  # noqa: F401  (cgx._C: the native module)
from cgx import mpi
from cgx._C import ProcessGroupCGX, compress, compressed_size, decompress
from cgx.backend import create_backend, exact, get_backend, stats
from cgx.config import Config, from_env
from cgx.adaptive import AdaptiveBits
from cgx.hooks import CGXState, cgx_hook
from cgx.diloco import DiLoCo
from cgx import elastic  # noqa: F401  (cgx.elastic.Membership)
from cgx.errors import CallMismatchError, CollectiveTimeoutError, MembershipError, PeerError
from cgx.layers import CompressionPolicy, LayerRule, LayerSetting

__all__ = [
    "ProcessGroupCGX",
    "Config",
    "from_env",
    "compress",
    "decompress",
    "compressed_size",
    "create_backend",
    "exact",
    "get_backend",
    "stats",
    "AdaptiveBits",
    "CGXState",
    "cgx_hook",
    "qsdp",
    "QSDP",
    "DiLoCo",
    "PeerError",
    "CollectiveTimeoutError",
    "CallMismatchError",
    "MembershipError",
    "CompressionPolicy",
    "LayerRule",
    "LayerSetting",
]
__version__ = "0.2.0"

# Under mpirun: torch's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the MPI launch.
mpi.adopt_mpi_launch()

# One backend object serves both devices (CUDA tensors are refused with the reason in a
# build without CUDA).
torch.distributed.Backend.register_backend(
    "cgx", create_backend, extended_api=True, devices=["cpu", "cuda"]
)


def __getattr__(name: str):
    # qsdp's module imports torch.distributed.fsdp and DTensor (about 0.5 s, a third of
    # `import cgx`): loaded on first use, so that a DDP or DiLoCo process (a replica that
    # joins a run, say) starts without it.
    if name in ("qsdp", "QSDP"):
        from cgx import fsdp

        return getattr(fsdp, name)
    if name in ("fsdp", "fsdp2_access"):  # the modules themselves (cgx.fsdp2_access.CHECKED_TORCH)
        return importlib.import_module(f"cgx.{name}")
    raise AttributeError(f"module 'cgx' has no attribute {name!r}")
