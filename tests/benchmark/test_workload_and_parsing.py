"""Pure tests: arrival times, prompts, dataset loading, SSE parsing, stream timing, CLI argument parsing."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from hpcserve.benchmark.bench import BenchOptions
from hpcserve.benchmark.loadgen import (
    LoadShape,
    RequestInput,
    _StreamTimer,
    completion_body,
    parse_sse_line,
)
from hpcserve.benchmark.workload import (
    LengthRange,
    arrival_offsets,
    load_dataset,
    parse_length_range,
    random_token_prompts,
)
from hpcserve.cli.bench import (
    build_loads,
    parse_int_list,
    parse_rate_list,
    read_api_key,
)
from hpcserve.core.errors import UsageError


def test_poisson_arrivals_are_seeded_increasing_and_have_the_right_rate():
    offsets = arrival_offsets(4000, request_rate=20.0, seed=1)
    assert offsets == arrival_offsets(4000, request_rate=20.0, seed=1)
    assert offsets != arrival_offsets(4000, request_rate=20.0, seed=2)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20.0, rel=0.1)  # exponential: sd == mean


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_random_prompts_have_the_drawn_lengths():
    fixed = random_token_prompts(5, LengthRange(64, 64), output_len=32, seed=0, vocab_size=500)
    assert all(len(p.prompt) == 64 == p.prompt_len and p.output_len == 32 for p in fixed)
    assert all(10 <= token < 500 for p in fixed for token in p.prompt)
    ranged = random_token_prompts(300, LengthRange(16, 32), output_len=8, seed=0)
    lengths = {len(p.prompt) for p in ranged}
    assert min(lengths) == 16 and max(lengths) == 32
    assert ranged == random_token_prompts(300, LengthRange(16, 32), output_len=8, seed=0)


@pytest.mark.parametrize("text, expected", [("64", (64, 64)), ("32:128", (32, 128)), ("32-128", (32, 128))])
def test_length_range_parsing(text, expected):
    assert parse_length_range(text) == LengthRange(*expected)


@pytest.mark.parametrize("text", ["", "a:b", "0:4", "9:3", "1:2:3"])
def test_bad_length_range_is_a_usage_error(text):
    with pytest.raises(UsageError, match="MIN:MAX"):
        parse_length_range(text)


def test_dataset_rows_default_output_len_and_cycle(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "output_len": 7}) + "\n\n" + json.dumps({"prompt": [1, 2, 3]}) + "\n")
    inputs = load_dataset(path, num_prompts=5, default_output_len=9)
    assert [i.output_len for i in inputs] == [7, 9, 7, 9, 7]
    assert inputs[1] == RequestInput(prompt=[1, 2, 3], output_len=9, prompt_len=3)
    assert len(load_dataset(path, num_prompts=None, default_output_len=9)) == 2


@pytest.mark.parametrize("line, message", [("{not json", ":1: not JSON"), ('{"text": "x"}', "'prompt' key"),
                                           ('{"prompt": ""}', "non-empty"), ('{"prompt": "x", "output_len": 0}',
                                                                               "'output_len'")])
def test_bad_dataset_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UsageError, match=message):
        load_dataset(path, None, 8)


def test_completion_body_makes_output_length_exact_and_asks_for_usage():
    body = completion_body("m", RequestInput(prompt=[1, 2], output_len=5), ignore_eos=True)
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_sse_parsing_skips_comments_blanks_and_done():
    assert parse_sse_line(b'data: {"a": 1}') == {"a": 1}
    assert parse_sse_line(b"data:[DONE]") is None
    assert parse_sse_line(b": ping") is None
    assert parse_sse_line(b"") is None


def test_stream_timer_follows_vllms_definitions():
    timer = _StreamTimer(sent_at=10.0)
    timer.on_chunk({"choices": [{"text": ""}]}, now=10.5)  # empty text still counts as the first token
    timer.on_chunk({"choices": [{"text": "a"}]}, now=10.6)
    timer.on_chunk({"choices": [{"text": "b"}]}, now=10.8)
    timer.on_chunk({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, now=11.5)
    out = timer.output(RequestInput("x", 3), run_start=9.0)
    assert out.ok and out.ttft_s == pytest.approx(0.5) and out.e2e_s == pytest.approx(0.8)  # usage chunk excluded
    assert out.itl_s == pytest.approx([0.1, 0.2]) and out.output_tokens == 3 and out.prompt_tokens == 4
    assert out.start_s == pytest.approx(1.0)


def test_stream_timer_counts_chunks_without_usage_and_fails_on_empty_stream():
    timer = _StreamTimer(sent_at=0.0)
    for t in (0.1, 0.2):
        timer.on_chunk({"choices": [{"text": "x"}]}, now=t)
    assert timer.output(RequestInput([1], 2, prompt_len=1), 0.0).output_tokens == 2
    empty = _StreamTimer(sent_at=0.0).output(RequestInput([1], 2), 0.0)
    assert not empty.ok and "before any token" in empty.error


def test_stream_error_event_raises_inside_the_request_to_be_recorded():
    with pytest.raises(RuntimeError, match="out of vocabulary"):
        _StreamTimer(sent_at=0.0).on_chunk({"error": {"message": "Token id 999 is out of vocabulary"}}, 1.0)


def test_sweeps():
    assert build_loads("1,4,16", None) == (LoadShape(1), LoadShape(4), LoadShape(16))
    assert build_loads(None, "1,2,inf") == (LoadShape(None, 1.0), LoadShape(None, 2.0), LoadShape(None, math.inf))
    assert build_loads("8", "1,2") == (LoadShape(8, 1.0), LoadShape(8, 2.0))
    assert build_loads(None, None) == (LoadShape(),)
    with pytest.raises(UsageError, match="not both"):
        build_loads("1,2", "1,2")


@pytest.mark.parametrize("call", [lambda: parse_int_list("--concurrency", "1,x"),
                                  lambda: parse_int_list("--concurrency", "0"),
                                  lambda: parse_rate_list("--request-rate", "fast"),
                                  lambda: parse_rate_list("--request-rate", "-1"),
                                  lambda: parse_rate_list("--request-rate", "nan")])
def test_bad_sweep_values_are_usage_errors(call):
    with pytest.raises(UsageError):
        call()


def test_api_key_env_must_be_set(monkeypatch):
    monkeypatch.delenv("HPCSERVE_TEST_KEY", raising=False)
    with pytest.raises(UsageError, match="HPCSERVE_TEST_KEY"):
        read_api_key("HPCSERVE_TEST_KEY")
    monkeypatch.setenv("HPCSERVE_TEST_KEY", "s3cret")
    assert read_api_key("HPCSERVE_TEST_KEY") == "s3cret"
    assert read_api_key(None) is None


@pytest.mark.parametrize("kwargs", [{"num_prompts": 0}, {"output_len": 0}, {"timeout_s": 0}, {"loads": ()},
                                    {"loads": (LoadShape(0),)}, {"gpus": 0}])
def test_options_reject_bad_values(kwargs):
    with pytest.raises(UsageError):
        BenchOptions(**kwargs)
