"""Creates ProcessGroupCGX for torch.distributed (the registered factory)."""

from __future__ import annotations

import torch.distributed as dist

from cgx import _C
from cgx.config import Config, from_env


def to_settings(config: Config) -> _C.Settings:
    settings = _C.Settings()
    settings.bits = config.bits
    settings.bucket_size = config.bucket_size
    settings.minimal_size = config.minimal_size
    settings.skip_incomplete_buckets = config.skip_incomplete_buckets
    settings.stochastic_rounding = config.stochastic_rounding
    settings.seed = config.seed
    settings.inner_communicator = _C.InnerCommunicator.__members__[config.inner_communicator]
    settings.inner_reduction = _C.ReductionAlgorithm.__members__[config.inner_reduction]
    settings.hostname = config.hostname
    settings.shm_ring_bytes = config.shm_ring_bytes
    return settings


def create_backend(dist_options, backend_options=None) -> _C.ProcessGroupCGX:
    """torch.distributed's factory for backend "cgx" (registered with extended_api=True).

    Reads the CGX_* variables (ValueError on a bad one), creates the Gloo backend that
    carries the exact path on its own prefix of the group's store, and connects the
    compressed path (shared memory between ranks of one host, Gloo across hosts).
    """
    config = from_env()
    store = dist_options.store
    rank, size, timeout = dist_options.group_rank, dist_options.group_size, dist_options.timeout
    exact = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    return _C.ProcessGroupCGX(
        dist.PrefixStore("cgx/", store), rank, size, timeout, exact, to_settings(config)
    )
