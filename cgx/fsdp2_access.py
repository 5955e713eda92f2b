"""Every use cgx makes of FSDP2's private internals, in one module, with the torch
releases it was checked against.

FSDP2's extension points for custom comms (``set_custom_all_gather`` /
``set_custom_reduce_scatter``) are public, but what cgx needs around them is not: the
base classes of the comms (in the private ``_fsdp_api`` module), and a unit's parameters
in the order of its flat buffer with their padded shard sizes and its shard group
(``_get_fsdp_state()._fsdp_param_group``, ``fsdp_params``, ``padded_sharded_param_size``,
``sharded_param``, ``mesh_info.shard_process_group``). A torch that changes them could
make cgx assign one parameter's bits to another's values; so on a torch outside
:data:`CHECKED_TORCH`, or where the base classes are missing, :func:`unsupported` gives
the reason, and where a unit lacks the attributes :func:`unit_parameters` raises
:class:`Unsupported`; either way ``cgx.qsdp`` leaves FSDP2's traffic exact, warns, and
shows the reason in its stats.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    _IMPORT_PROBLEM = None
except ImportError as e:  # a torch that moved them: qsdp stays exact (unsupported())
    AllGather = ReduceScatter = object
    _IMPORT_PROBLEM = str(e)

__all__ = ["CHECKED_TORCH", "AllGather", "ReduceScatter", "Unsupported", "UnitParameters", "unit_parameters",
           "unsupported"]

# The torch releases (major, minor) on which tests/test_fsdp.py passed with this module.
CHECKED_TORCH = ((2, 11), (2, 12), (2, 13))


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def unsupported(version: str = torch.__version__) -> str | None:
    """Why cgx cannot compress FSDP2's traffic on torch `version` (None: it can)."""
    checked = ", ".join(f"{major}.{minor}" for major, minor in CHECKED_TORCH)
    if _release(version) not in CHECKED_TORCH:
        return (f"torch {version} is not among the releases cgx's FSDP2 adapter was checked "
                f"against ({checked}): FSDP2's internals may differ, so its traffic stays exact")
    if _IMPORT_PROBLEM:
        return f"FSDP2's custom-comm base classes are not where torch {version} had them: {_IMPORT_PROBLEM}"
    return None


class UnitParameters(NamedTuple):
    group: dist.ProcessGroup  # the group the unit shards over
    shards: list[tuple[torch.nn.Parameter, int]]  # in buffer order: parameter, padded shard numel


class Unsupported(Exception):
    """FSDP2's internals are not what this module reads; the message says which."""


def unit_parameters(module: torch.nn.Module) -> UnitParameters | None:
    """The parameters of FSDP2 unit `module` as its comms see them (None: it has none)."""
    try:
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None:
            return None
        shards = [(p.sharded_param, p.padded_sharded_param_size.numel()) for p in param_group.fsdp_params]
        return UnitParameters(param_group.mesh_info.shard_process_group, shards)
    except AttributeError as e:
        raise Unsupported(f"FSDP2's internals on torch {torch.__version__} are not what cgx reads ({e}), "
                          f"so its traffic stays exact") from None
