"""Decode role: the decode scheduler (pre-allocation queue, waiting-for-KV with deadlines,
running batch, preemption; ``scheduler.py``, ``types.py``) and the decode worker that sends
prefill jobs, receives the KV, decodes and bills each request (``worker.py``)."""
