"""Members of an endpoint in replica groups (a heterogeneous pool): pure configuration, no processes."""

from __future__ import annotations

from pathlib import Path

import yaml

from hpcserve.core.config import DeploymentConfig, Layout
from hpcserve.endpoint.control.members import group_layouts, member_config

REPLICAS = Path(__file__).parents[1] / "cluster" / "sandbox-replicas.yaml"


def endpoint_config(**changes) -> DeploymentConfig:
    data = yaml.safe_load(REPLICAS.read_text())
    data.update(changes)
    return DeploymentConfig(**data)


def test_each_replica_of_each_group_is_one_member_of_its_own_shape():
    cfg = endpoint_config(parallelism={"tensor": 1, "pipeline": 1, "replicas": 2},
                          replica_groups=[{"replicas": 1, "tensor": 2}, {"replicas": 2, "engine_args": ["-x"]}])
    shapes = group_layouts(cfg, cfg.parallelism)
    assert [group for group, _ in shapes] == [0, 0, 1, 2, 2]
    assert all(layout.replicas == 1 for _, layout in shapes)
    assert [layout.tensor for _, layout in shapes] == [1, 1, 2, 1, 1]


def test_a_group_member_runs_the_deployment_changed_as_its_group_says(tmp_path):
    cfg = endpoint_config(replica_groups=[{"replicas": 1, "tensor": 2, "cpus_per_node": 2, "partition": "big",
                                           "engine_args": ["--max-num-seqs", "1"]}])
    base = member_config(cfg, "m0", 0, Layout(), tmp_path)
    member = member_config(cfg, "m1", 1, Layout(tensor=2), tmp_path, group=1)
    assert base.cluster.partition is None and base.engine.args == cfg.engine.args
    assert member.cluster.partition == "big" and member.cluster.cpus_per_node == 2
    assert member.cluster.nodes == 1  # tensor 2 fits on one node of 2 CPUs
    assert member.engine.args[-2:] == ["--max-num-seqs", "1"]  # after the deployment's own: the last wins
    assert member.replica_groups == [] and member.serve.router is False
    assert member.serve.port == cfg.serve.port + 1 + 8
