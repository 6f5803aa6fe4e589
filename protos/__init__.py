"""gRPC protocol: ``tandem.proto`` and its generated stubs (``python -m tandem.protos.generate``)."""
