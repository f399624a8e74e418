"""`hpcserve bench`: load generation, latency/throughput summaries, sweeps, plots and comparisons.

Library use (what `hpcserve validate` and the baselines call):

    from hpcserve.benchmark import BenchOptions, LoadShape, run_benchmark
    result = run_benchmark(resolve_endpoint("my-deployment"), BenchOptions(loads=(LoadShape(concurrency=8),)))
"""

from hpcserve.benchmark.bench import (
           BenchmarkError,
           BenchOptions,
           run_benchmark,
           run_benchmark_async,
)
from hpcserve.benchmark.loadgen import LoadShape, RequestInput, RequestOutput
from hpcserve.benchmark.summary import BenchResult, BenchRun, RunSummary, load_result

__all__ = ["BenchOptions", "BenchResult", "BenchRun", "BenchmarkError", "LoadShape", "RequestInput", "RequestOutput",
           "RunSummary", "load_result", "run_benchmark", "run_benchmark_async"]
