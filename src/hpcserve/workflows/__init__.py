"""Workflows built on the API: single-node validation and the single- vs multi-node baseline
(up -> measure -> down)."""
