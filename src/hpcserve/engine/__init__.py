"""Layer 3: the vLLM engine — its command line, its processes, its version quirks."""
