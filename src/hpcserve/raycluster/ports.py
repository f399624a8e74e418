"""Ports for one deployment's Ray cluster, chosen so two users' jobs on one node don't clash.

Ray's fixed defaults (GCS 6379, client server 10001, dashboard agent 52365) are the same for
everybody: two jobs sharing a node would collide. Ray's other ports (node manager, object manager,
workers, metrics) are picked free at random by Ray itself. Each deployment takes a block of consecutive ports whose start is derived from its
run id (stable, so every node computes the same block) and checked free on the head node. Blocks lie
between Ray's worker ports (10002-19999 by default) and the kernel's ephemeral range: a port in that
range can be any outgoing connection's source port by the time Ray binds it (a GCS failed to start on
port 47568 so, "Address already in use", in a run of the test suite).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hpcserve.core.net import first_ephemeral_port, port_free

BLOCK_SIZE = 16
FIRST_PORT = 20000
MIN_BLOCKS = 64  # with less room below the ephemeral range (a site's own port range), the blocks go up to:
FALLBACK_END = 52000


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


def block_count(first_ephemeral: int) -> int:
    below = (first_ephemeral - FIRST_PORT) // BLOCK_SIZE
    return below if below >= MIN_BLOCKS else (FALLBACK_END - FIRST_PORT) // BLOCK_SIZE


def block_for(run_id: str, attempt: int = 0, first_ephemeral: int = 32768) -> PortBlock:
    digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).digest()
    index = int.from_bytes(digest[:4], "big") % block_count(first_ephemeral)
    return PortBlock(FIRST_PORT + index * BLOCK_SIZE)



def free_block(run_id: str, tries: int = 20) -> PortBlock:
    """The first block, derived from run_id, whose ports are all free on this node."""
    first_ephemeral = first_ephemeral_port()
    for attempt in range(tries):
        block = block_for(run_id, attempt, first_ephemeral)
        if all(port_free(block.base + i) for i in range(BLOCK_SIZE)):
            return block
    raise RuntimeError(f"no free block of {BLOCK_SIZE} ports found on this node after {tries} tries")
