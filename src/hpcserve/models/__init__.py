"""Models hpcserve can build or inspect locally (no downloads)."""
