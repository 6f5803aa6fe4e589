"""What every rank shares: request state, page allocator, prefix cache and KV events, the
colocated scheduler and engine, the model runner, expert-parallel dispatch, the one rank loop,
and the torch-free messages between processes (``messages.py``)."""
