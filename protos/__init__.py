"""gRPC protocol: ``tandem.proto`` and its generated stubs. Not built yet."""
