"""Benchmarks (run on a GPU machine; see docs/BENCHMARKS.md)."""
