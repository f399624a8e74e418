"""Ports for one deployment's Ray cluster, chosen so two users' jobs on one node don't clash.

Ray's fixed defaults (GCS 6379, client server 10001, dashboard agent 52365) are the same for
everybody: two jobs sharing a node would collide. Ray's other ports (node manager, object manager,
workers, metrics) are picked free at random by Ray itself. Each deployment takes a block of consecutive ports whose start is derived from its
run id (stable, so every node computes the same block) and checked free on the head node.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hpcserve.core.net import port_free

BLOCK_SIZE = 16
FIRST_PORT = 20000
BLOCKS = 2000  # 20000 .. 52000


@dataclass(frozen=True)
class PortBlock:
    base: int

    @property
    def gcs(self) -> int:
        return self.base

    @property
    def client_server(self) -> int:
        return self.base + 1

    @property
    def dashboard_agent_listen(self) -> int:
        return self.base + 2

    @property
    def collective(self) -> int:
        """For the health check's all-reduce rendezvous."""
        return self.base + 3

    @property
    def engine_master(self) -> int:
        """vLLM's multi-node --master-port (one per replica: + replica index)."""
        return self.base + 4


def block_for(run_id: str, attempt: int = 0) -> PortBlock:
    digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).digest()
    index = int.from_bytes(digest[:4], "big") % BLOCKS
    return PortBlock(FIRST_PORT + index * BLOCK_SIZE)



def free_block(run_id: str, tries: int = 20) -> PortBlock:
    """The first block, derived from run_id, whose ports are all free on this node."""
    for attempt in range(tries):
        block = block_for(run_id, attempt)
        if all(port_free(block.base + i) for i in range(BLOCK_SIZE)):
            return block
    raise RuntimeError(f"no free block of {BLOCK_SIZE} ports found on this node after {tries} tries")
