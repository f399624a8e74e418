"""The CLI's error handling, --compare and the plots, on synthetic results files (no server)."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from hpcserve.benchmark.compare import Column, scaling_efficiency
from hpcserve.benchmark.loadgen import LoadShape, RequestOutput
from hpcserve.benchmark.plots import write_plots
from hpcserve.benchmark.summary import BenchResult, BenchRun, RequestRecord, summarize
from hpcserve.cli.bench import bench

app = typer.Typer()
app.command("bench")(bench)


@app.command("other")
def _other() -> None:  # a second command so typer keeps "bench" as a subcommand, as in hpcserve's CLI
    pass


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def result(throughput_scale: float, gpus: int | None, loads=(1, 4)) -> BenchResult:
    runs = []
    for concurrency in loads:
        outputs = [RequestOutput(ok=True, ttft_s=0.05 * (i + 1), e2e_s=0.5 + 0.01 * i, output_tokens=32,
                                 prompt_tokens=64, itl_s=[0.01] * 31, start_s=0.1 * i) for i in range(20)]
        runs.append(BenchRun(load=LoadShape(concurrency).as_dict(),
                             summary=summarize(outputs, duration_s=10.0 / (throughput_scale * concurrency)),
                             requests=[RequestRecord.of(o) for o in outputs]))
    return BenchResult(target="t", date="2026-01-01T00:00:00+00:00", command=["x"], config={}, endpoints=["u"],
                       runs=runs, gpus=gpus)


def test_bad_arguments_exit_2_with_one_message_and_no_traceback():
    for args in (["http://127.0.0.1:9", "--concurrency", "a,b"], ["http://127.0.0.1:9", "--slo", "ttft=1"],
                 ["http://127.0.0.1:9", "--input-len-range", "9:3"], [], ["--compare", "only-one.json"],
                 ["http://127.0.0.1:9", "--out", "/no/such/folder/r.json"]):
        outcome = invoke(*args)
        assert outcome.exit_code == 2, (args, outcome.output)
        assert "error:" in outcome.output and "Traceback" not in outcome.output


def test_unknown_deployment_is_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCSERVE_HOME", str(tmp_path))
    outcome = invoke("no-such-deployment")
    assert outcome.exit_code == 2 and "no deployment named" in outcome.output


def test_unreachable_endpoint_is_one_clear_error():
    outcome = invoke("http://127.0.0.1:9", "--model", "m", "--num-prompts", "2", "--timeout", "5")
    assert outcome.exit_code == 1 and "warm-up request to http://127.0.0.1:9" in outcome.output
    assert "Traceback" not in outcome.output


def test_scaling_efficiency_divides_by_gpu_ratio_when_known():
    base, double = result(1.0, gpus=1), result(1.8, gpus=2)
    assert scaling_efficiency(Column("a", 1, base.runs[0]), Column("b", 2, double.runs[0])) == 0.9
    assert scaling_efficiency(Column("a", None, base.runs[0]), Column("b", 2, double.runs[0])) == 1.8


def test_compare_prints_side_by_side(tmp_path):
    result(1.0, gpus=1).save(tmp_path / "one.json")
    result(1.8, gpus=2, loads=(4,)).save(tmp_path / "two.json")
    outcome = CliRunner().invoke(app, ["bench", "--compare", str(tmp_path / "one.json"), str(tmp_path / "two.json")],
                                 env={"COLUMNS": "200"})
    assert outcome.exit_code == 0, outcome.output
    assert "load: concurrency=4" in outcome.output and "scaling efficiency" in outcome.output
    assert "90%" in outcome.output


def test_plots_are_written(tmp_path):
    paths = write_plots(result(1.0, gpus=None), tmp_path / "plots")
    assert [p.name for p in paths] == ["throughput_latency.png", "ttft_distribution.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
