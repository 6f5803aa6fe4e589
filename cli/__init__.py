"""The ``tandem`` command: model tools, generation (colocated, on a DEP group, or through a
cluster's frontend), ``serve``, the gRPC client and the benchmarks."""
