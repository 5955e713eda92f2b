"""Streaming DiLoCo (:class:`DiLoCo`) and its machinery: the fragments and their sync
(`outer_sync`), sparse outer gradients (`sparse`), an elastic run's recovery (`recovery`), a host's DDP group as one
replica (`replica_host`). The modules here share private names; nothing outside this
package imports one (tests/test_layout.py)."""

from cgx.diloco.diloco import DiLoCo
from cgx.diloco.sparse import TopK

__all__ = ["DiLoCo", "TopK"]
