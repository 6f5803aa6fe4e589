"""KV cache transfer between ranks: the transport interface, the NIXL backend (agents, pool
registration, descriptor building, WRITE + notify, deadlines, abort), the metadata handshake and
per-transfer statistics."""
