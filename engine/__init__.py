"""What every rank shares: request state, page allocator, prefix cache and KV events, the
scheduler, the model runner and the colocated engine."""
