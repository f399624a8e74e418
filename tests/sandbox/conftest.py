"""The `sandbox` fixture lives in tests/conftest.py: tests/cluster uses the same cluster."""
