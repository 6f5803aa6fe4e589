"""The frontend: an async Ray actor that hosts the gRPC server, tokenises, routes each request to
a prefill and a decode rank, and streams tokens back with their timings and the request's bill."""
