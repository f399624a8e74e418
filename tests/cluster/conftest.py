"""What the serving tests on the sandbox share: its Slurm environment and a key for the endpoint."""

from __future__ import annotations

import os

import pytest
from test_slurm_ray import assert_nodes_clean


@pytest.fixture()
def slurm_env(sandbox, hpcserve_home, monkeypatch):
    """The sandbox's Slurm clients and a fresh API key; afterwards every node is up again (a test may
    have killed one) and nothing of the test runs on any node."""
    for key, value in sandbox.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HPCSERVE_API_KEY", "test-key-" + os.urandom(6).hex())
    yield sandbox
    for node in sandbox.node_names():
        if not sandbox.init_pid(node):
            sandbox.start_node(node)
    assert_nodes_clean(sandbox)
