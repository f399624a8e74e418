"""Deliberate test doubles, used by the test suite and the benchmarks (never by the product): the
stand-in engine that speaks vLLM's HTTP API without a model."""
