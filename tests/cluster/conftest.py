"""What the serving tests on the sandbox share: its Slurm environment and a key for the endpoint."""

from __future__ import annotations

import os

import pytest
from test_slurm_ray import assert_nodes_clean


def restore_nodes(sandbox) -> None:
    """Every node up again (a test may have killed one), and nothing of the test left on any node."""
    for node in sandbox.node_names():
        if not sandbox.init_pid(node):
            sandbox.start_node(node)
    assert_nodes_clean(sandbox)


def slurm_variables(sandbox) -> dict[str, str]:
    return {**sandbox.env(), "HPCSERVE_API_KEY": "test-key-" + os.urandom(6).hex()}


@pytest.fixture()
def slurm_env(sandbox, hpcserve_home, monkeypatch):
    """The sandbox's Slurm clients and a fresh API key, for one test."""
    for key, value in slurm_variables(sandbox).items():
        monkeypatch.setenv(key, value)
    yield sandbox
    restore_nodes(sandbox)


@pytest.fixture(scope="module")
def slurm_module_env(sandbox, hpcserve_home):
    """The same for a deployment that several tests of one module only read from."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in slurm_variables(sandbox).items():
            patch.setenv(key, value)
        yield sandbox
        restore_nodes(sandbox)
