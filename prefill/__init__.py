"""Prefill role: jobs from decode ranks (``job.py``), the prefill scheduler (token budget,
chunking, prefix reuse, pages held while their KV is sent; ``scheduler.py``) and the prefill
worker that runs them and writes each layer's KV to the decode rank (``worker.py``)."""
