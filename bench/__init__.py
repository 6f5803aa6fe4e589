"""Benchmarks: the engine, DEP groups, KV transfer, disaggregated against colocated, the router
over a trace, and the GPU kernel check."""
