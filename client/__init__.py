"""Tandem's gRPC client, as a library: requests from prompt specs, streams with their bills,
prompt files. No Ray, no torch: the benchmarks and the ``tandem client`` command use it."""
