"""The baseline report's arithmetic (pure): scaling efficiency of the configured layout against one node."""

from test_cli_compare_plots import result  # noqa: E402 - a sibling test module (rootdir on sys.path)

from hpcserve.core.config import parse_config
from hpcserve.workflows.baseline import report_lines, workers

CONFIG = parse_config({"name": "b", "model": {"path": "builtin:tiny-llama"},
                       "cluster": {"scheduler": "slurm", "nodes": 2, "gpus_per_node": 4},
                       "parallelism": {"tensor": 4, "pipeline": 1, "replicas": 2}})


def test_workers_counts_every_gpu_of_every_replica():
    assert workers(CONFIG) == 8


def test_report_has_a_row_per_layout_and_load_with_efficiency():
    single, multi = result(1.0, gpus=4), result(1.6, gpus=8)  # 1.6x the throughput on 2x the GPUs
    lines = report_lines(CONFIG, single, multi)
    rows = [line for line in lines if line.startswith("| concurrency")]
    assert len(rows) == 4  # two loads x two layouts
    assert all(row.split("|")[-2].strip() == "1.00" for row in rows if "single node" in row)
    assert all(row.split("|")[-2].strip() == "0.80" for row in rows if "configured" in row)
    assert "2 nodes" in lines[0]
