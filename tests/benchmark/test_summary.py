"""Pure tests: the percentile (hpcserve.benchmark.stats), TPOT, goodput, SLO parsing, results round trip. Synthetic RequestOutputs only."""

from __future__ import annotations

import json
import math

import pytest

from hpcserve.benchmark.loadgen import LoadShape, RequestOutput
from hpcserve.benchmark.stats import percentile
from hpcserve.benchmark.summary import (
    BenchResult,
    BenchRun,
    RequestRecord,
    first_errors,
    load_result,
    meets_slo,
    parse_slo,
    summarize,
    tpot_s,
)
from hpcserve.core.errors import UsageError


def ok(ttft: float, e2e: float, tokens: int = 11, prompt: int = 100, itl: list[float] | None = None) -> RequestOutput:
    return RequestOutput(ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, prompt_tokens=prompt,
                         itl_s=itl if itl is not None else [(e2e - ttft) / max(tokens - 1, 1)] * (tokens - 1))


def failed(error: str = "HTTP 500: boom") -> RequestOutput:
    return RequestOutput(ok=False, error=error)


@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 2.5), (100, 4.0), (90, 3.7), (99, 3.97)])
def test_percentile_interpolates_like_numpy(q, expected):
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None


def test_tpot_excludes_the_first_token():
    assert tpot_s(ok(ttft=0.1, e2e=1.1, tokens=11)) == pytest.approx(0.1)


def test_tpot_undefined_for_single_token_and_failures():
    assert tpot_s(ok(ttft=0.1, e2e=0.1, tokens=1)) is None
    assert tpot_s(failed()) is None


def test_summary_throughputs_use_successful_requests_only():
    outputs = [ok(0.1, 1.1, tokens=11, prompt=100), ok(0.2, 1.2, tokens=11, prompt=50), failed()]
    summary = summarize(outputs, duration_s=2.0)
    assert (summary.completed, summary.failed) == (2, 1)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(11.0)
    assert summary.input_throughput == pytest.approx(75.0)
    assert summary.ttft_ms.p50 == pytest.approx(150.0)
    assert summary.tpot_ms.mean == pytest.approx(100.0)
    assert summary.e2e_ms.p99 == pytest.approx(1199.0)
    assert summary.goodput is None
    assert summary.first_errors == ["HTTP 500: boom"]


def test_itl_percentiles_pool_all_gaps():
    summary = summarize([ok(0.1, 0.4, tokens=3, itl=[0.1, 0.2]), ok(0.1, 0.5, tokens=3, itl=[0.3, 0.1])], 1.0)
    assert summary.itl_ms.p50 == pytest.approx(150.0)
    assert summary.itl_ms.mean == pytest.approx(175.0)


def test_all_failed_gives_empty_stats_not_an_error():
    summary = summarize([failed(), failed("ReadTimeout")], duration_s=1.0, slo={"ttft_ms": 100})
    assert summary.completed == 0 and summary.ttft_ms.p50 is None and summary.goodput == 0.0
    assert summary.first_errors == ["HTTP 500: boom", "ReadTimeout"]


def test_goodput_counts_requests_meeting_every_slo():
    slo = parse_slo("ttft_ms=500,tpot_ms=50")
    fast = ok(ttft=0.2, e2e=0.2 + 10 * 0.04, tokens=11)
    slow_first_token = ok(ttft=0.6, e2e=0.6 + 10 * 0.01, tokens=11)
    slow_decode = ok(ttft=0.1, e2e=0.1 + 10 * 0.06, tokens=11)
    assert [meets_slo(o, slo) for o in (fast, slow_first_token, slow_decode)] == [True, False, False]
    summary = summarize([fast, slow_first_token, slow_decode, failed()], duration_s=2.0, slo=slo)
    assert summary.goodput == pytest.approx(0.5)


def test_single_token_request_has_tpot_zero_for_goodput():
    assert meets_slo(ok(ttft=0.1, e2e=0.1, tokens=1), {"tpot_ms": 1})


@pytest.mark.parametrize("text", ["ttft=500", "ttft_ms", "ttft_ms=fast", "ttft_ms=-1", "itl_ms=3"])
def test_bad_slo_is_a_usage_error_naming_the_item(text):
    with pytest.raises(UsageError, match="--slo"):
        parse_slo(text)


def test_slo_accepts_e2e():
    assert parse_slo("e2e_ms=2000, ttft_ms=300") == {"e2e_ms": 2000.0, "ttft_ms": 300.0}


def test_first_errors_are_distinct_and_capped():
    outputs = [failed(f"error {i % 7}") for i in range(30)]
    assert first_errors(outputs, limit=5) == [f"error {i}" for i in range(5)]


def _result(rate: float = math.inf) -> BenchResult:
    outputs = [ok(0.1, 1.1), failed()]
    run = BenchRun(load=LoadShape(4, rate).as_dict(), summary=summarize(outputs, 1.0, {"ttft_ms": 500}),
                   requests=[RequestRecord.of(o) for o in outputs], started_at=1767225600.25)
    return BenchResult(target="http://x:8000", date="2026-01-01T00:00:00+00:00", command=["hpcserve", "bench"],
                       config={"seed": 0}, endpoints=["http://x:8000"], runs=[run], gpus=2)


def test_result_is_strict_json_and_round_trips(tmp_path):
    result = _result()
    path = tmp_path / "r.json"
    result.save(path)
    data = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert data["runs"][0]["load"] == {"concurrency": 4, "request_rate": "inf"}
    assert load_result(path) == result


def test_loading_a_foreign_file_is_a_usage_error(tmp_path):
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(UsageError, match="not an `hpcserve bench` results file"):
        load_result(tmp_path / "other.json")
    with pytest.raises(UsageError, match="no such file"):
        load_result(tmp_path / "missing.json")


def test_load_labels():
    assert LoadShape(4).label == "concurrency=4"
    assert LoadShape(None, 2.5).label == "rate=2.5"
    assert LoadShape().label == "rate=inf"
    assert LoadShape(8, 2).label == "concurrency=8,rate=2"
    assert BenchRun(load=LoadShape(None, 1.0).as_dict(), summary=_result().runs[0].summary).label == "rate=1"
