"""Benchmarks: load generation, trace replay, reports."""
