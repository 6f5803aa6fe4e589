"""Prefill role: jobs from decode ranks (``job.py``), the prefill scheduler (token budget,
chunking, prefix reuse, pages held while their KV is sent; ``scheduler.py``), the prefill worker
that runs them, writes each layer's KV to the decode rank and publishes KV events (``worker.py``,
``kv_events.py``) and its role spec (``role.py``)."""
