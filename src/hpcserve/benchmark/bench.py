"""The library entry point: `run_benchmark(endpoints, options) -> BenchResult`.

Used by `hpcserve bench`, `hpcserve validate` and the baselines. Sync-callable (it runs its own event
loop); code that already runs inside an event loop awaits `run_benchmark_async` instead.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Protocol

import aiohttp

from hpcserve.benchmark.loadgen import (
    LoadShape,
    RequestInput,
    RequestOutput,
    make_session,
    run_load,
    send_request,
)
from hpcserve.benchmark.summary import BenchResult, BenchRun, RequestRecord, summarize
from hpcserve.benchmark.workload import (
    DEFAULT_VOCAB_SIZE,
    LengthRange,
    arrival_offsets,
    load_dataset,
    random_token_prompts,
)
from hpcserve.core.errors import HpcserveError, UsageError
from hpcserve.core.keys import bearer
from hpcserve.engine.client import Endpoint

DEFAULT_NUM_PROMPTS = 100


class BenchmarkError(HpcserveError):
    """The benchmark could not start: no model name, or an endpoint failed its warm-up request."""


@dataclass(frozen=True)
class BenchOptions:
    """Everything that shapes a benchmark. `loads` is the sweep: one run per LoadShape, in order."""

    loads: tuple[LoadShape, ...] = (LoadShape(),)
    num_prompts: int | None = None  # None: DEFAULT_NUM_PROMPTS random prompts, or the whole dataset
    input_len: LengthRange = LengthRange(128, 128)
    output_len: int = 128
    dataset: str | None = None  # JSONL of {"prompt": ..., "output_len": ...}; replaces random prompts
    model: str | None = None  # overrides the endpoints' model; None: the endpoint's, else asked from /v1/models
    slo: dict[str, float] = field(default_factory=dict)  # e.g. {"ttft_ms": 500, "tpot_ms": 50}
    seed: int = 0
    timeout_s: float = 600.0  # deadline of each load point
    ignore_eos: bool = True  # with max_tokens, makes every output exactly output_len tokens
    warmup_requests: int = 1  # per endpoint, before the first run; not measured
    vocab_size: int = DEFAULT_VOCAB_SIZE  # random token ids are drawn below this
    gpus: int | None = None  # recorded in the result; `--compare` divides throughput by it

    def __post_init__(self) -> None:
        _require(len(self.loads) > 0, "give at least one load point (--concurrency or --request-rate)")
        _require(self.num_prompts is None or self.num_prompts >= 1, "--num-prompts must be at least 1")
        _require(self.output_len >= 1, "--output-len must be at least 1")
        _require(self.timeout_s > 0, "--timeout must be positive")
        _require(self.warmup_requests >= 0, "warmup_requests must be 0 or more")
        _require(self.gpus is None or self.gpus >= 1, "--gpus must be at least 1")
        for load in self.loads:
            _require(load.concurrency is None or load.concurrency >= 1, "--concurrency values must be at least 1")
            _require(load.request_rate > 0, "--request-rate values must be positive (or inf)")

    def as_config(self) -> dict:
        """JSON-safe description for the results file."""
        return {**asdict(self), "loads": [load.as_dict() for load in self.loads]}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


class Progress(Protocol):
    """What a caller (the CLI's progress bar) is told while the benchmark runs."""

    def start_run(self, label: str, total: int) -> None: ...

    def request_done(self, output: RequestOutput) -> None: ...


def run_benchmark(endpoints: Sequence[Endpoint], options: BenchOptions, *, target: str | None = None,
                  command: Sequence[str] | None = None, progress: Progress | None = None) -> BenchResult:
    """Run every load point of `options` against the endpoints (round-robin) and summarise each."""
    with asyncio.Runner(loop_factory=_fast_event_loop_factory()) as runner:
        return runner.run(run_benchmark_async(endpoints, options, target=target, command=command, progress=progress))


def _fast_event_loop_factory():
    """uvloop when installed (vLLM brings it): ~30% less client CPU per streamed token, measured. On a
    machine shared with the server, client CPU is server CPU lost, so a lighter client measures truer."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def run_benchmark_async(endpoints: Sequence[Endpoint], options: BenchOptions, *, target: str | None = None,
                              command: Sequence[str] | None = None,
                              progress: Progress | None = None) -> BenchResult:
    _require(len(endpoints) > 0, "no endpoint to benchmark")
    ready = [await _with_model(endpoint, options) for endpoint in endpoints]
    inputs = build_inputs(options)
    await warm_up(ready, inputs[0], options)
    runs = [await _run_one_load(ready, inputs, load, options, progress) for load in options.loads]
    return BenchResult(
        target=target or ready[0].base_url, date=datetime.now(UTC).isoformat(timespec="seconds"),
        command=list(command if command is not None else sys.argv), config=options.as_config(),
        endpoints=[endpoint.base_url for endpoint in ready], runs=runs, gpus=options.gpus,
    )


def build_inputs(options: BenchOptions) -> list[RequestInput]:
    if options.dataset:
        return load_dataset(options.dataset, options.num_prompts, options.output_len)
    count = options.num_prompts or DEFAULT_NUM_PROMPTS
    return random_token_prompts(count, options.input_len, options.output_len, options.seed, options.vocab_size)


async def _run_one_load(endpoints: list[Endpoint], inputs: list[RequestInput], load: LoadShape,
                        options: BenchOptions, progress: Progress | None) -> BenchRun:
    if progress:
        progress.start_run(load.label, len(inputs))
    offsets = arrival_offsets(len(inputs), load.request_rate, options.seed)
    result = await run_load(endpoints, inputs, load, offsets, timeout_s=options.timeout_s,
                            ignore_eos=options.ignore_eos, on_done=progress.request_done if progress else None)
    return BenchRun(load=load.as_dict(), summary=summarize(result.outputs, result.duration_s, options.slo),
                    requests=[RequestRecord.of(output) for output in result.outputs], started_at=result.started_at)


async def _with_model(endpoint: Endpoint, options: BenchOptions) -> Endpoint:
    """The endpoint with a model name: --model, else the deployment's, else the server's first model."""
    if options.model or endpoint.model:
        return replace(endpoint, model=options.model or endpoint.model)
    return replace(endpoint, model=await discover_model(endpoint, timeout_s=min(options.timeout_s, 30.0)))


async def discover_model(endpoint: Endpoint, timeout_s: float = 30.0) -> str:
    url = f"{endpoint.base_url}/v1/models"
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (aiohttp.ClientSession(timeout=timeout, trust_env=False) as session,
                    session.get(url, headers=bearer(endpoint.api_key), raise_for_status=True) as response):
            return (await response.json(content_type=None))["data"][0]["id"]
    except aiohttp.ClientResponseError as exc:
        if exc.status in (401, 403):
            raise UsageError(unauthorized_message(url, exc.status, endpoint.api_key)) from None
        raise BenchmarkError(f"could not learn the model name from {url} (HTTP {exc.status}: {exc.message}); "
                             f"pass --model NAME") from None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchmarkError(f"could not learn the model name from {url} ({type(exc).__name__}: {exc}); "
                             f"pass --model NAME") from None


def unauthorized_message(url: str, status: int, api_key: str | None) -> str:
    """What to do when the server refuses us: which option gives the key. Pure."""
    if api_key:
        return (f"{url} answered HTTP {status}: it refused the API key sent. Check that --api-key-env names the "
                "variable holding this endpoint's key (or bench the deployment by name: its key is found for you)")
    return (f"{url} answered HTTP {status}: the endpoint needs an API key. Pass --api-key-env NAME (an environment "
            "variable holding the key), or bench the deployment by name instead of its URL")


async def warm_up(endpoints: list[Endpoint], request: RequestInput, options: BenchOptions) -> None:
    """Unmeasured requests so the first measured ones don't pay for cold caches or connections.

    A failure here stops the benchmark with the server's answer: a wrong model name or key would
    otherwise show up as hundreds of identical failed requests.
    """
    try:
        async with asyncio.timeout(options.timeout_s), make_session(LoadShape(1), options.timeout_s) as session:
            for endpoint in endpoints:
                for _ in range(options.warmup_requests):
                    await _warm_up_once(session, endpoint, request, options.ignore_eos)
    except TimeoutError:
        raise BenchmarkError(f"the warm-up requests took longer than --timeout {options.timeout_s:g} s") from None


async def _warm_up_once(session: aiohttp.ClientSession, endpoint: Endpoint, request: RequestInput,
                        ignore_eos: bool) -> None:
    output = await send_request(session, endpoint, request, ignore_eos, run_start=0.0)
    error = output.error or ""
    if not output.ok and error.startswith(("HTTP 401", "HTTP 403")):
        raise UsageError(unauthorized_message(endpoint.base_url, int(error[5:8]), endpoint.api_key))
    if not output.ok:
        raise BenchmarkError(f"warm-up request to {endpoint.base_url} (model '{endpoint.model}') failed: "
                             f"{output.error}")
