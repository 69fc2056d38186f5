"""Benchmarks: run with `.venv/bin/python -m pytest benchmarks` (not part of the test suite)."""
