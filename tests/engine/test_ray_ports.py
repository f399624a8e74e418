"""A deployment's Ray ports: one block per run, above Ray's worker ports and below the kernel's ephemeral
range (where any outgoing connection may hold a port by the time Ray binds it)."""

from __future__ import annotations

from hpcserve.core.net import first_ephemeral_port
from hpcserve.raycluster.ports import BLOCK_SIZE, FIRST_PORT, block_for, free_block


def test_blocks_lie_between_rays_worker_ports_and_the_ephemeral_range():
    for first_ephemeral in (32768, 49152, 24000):
        bases = {block_for(f"run-{i}", 0, first_ephemeral).base for i in range(2000)}
        assert min(bases) >= FIRST_PORT and max(bases) + BLOCK_SIZE <= first_ephemeral
        assert len(bases) > 200  # spread: two deployments on a node rarely meet
    assert block_for("run-1", 0) == block_for("run-1", 0) != block_for("run-1", 1)  # stable per run and attempt


def test_with_no_room_below_the_ephemeral_range_blocks_still_exist():
    bases = {block_for(f"run-{i}", 0, first_ephemeral=1024).base for i in range(500)}
    assert min(bases) >= FIRST_PORT and max(bases) < 52000


def test_the_free_block_of_this_machine_is_below_its_ephemeral_range():
    assert free_block("a-run").base + BLOCK_SIZE <= first_ephemeral_port()
