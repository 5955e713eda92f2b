"""Streaming DiLoCo (:class:`DiLoCo`, with its schedule) and its machinery, a module per
noun: the fragments and the synced set (`fragments`), a sync of each kind (`syncs`), the
replicas and their agreement (`replicas`), sparse outer gradients (`sparse`), checkpoints
(`checkpoint`), an elastic run's recovery (`recovery`, which knows DiLoCo only through its
`Recoverable`), a host's DDP group as one replica (`replica_host`). Nothing outside this
package imports a private name of one (tests/test_layout.py)."""

from cgx.diloco.diloco import DiLoCo
from cgx.diloco.sparse import TopK

__all__ = ["DiLoCo", "TopK"]
