"""Decode role: the decode scheduler (pre-allocation queue, waiting-for-KV with deadlines,
running batch, preemption; ``scheduler.py``, ``types.py``), the decode worker that sends prefill
jobs, receives the KV, decodes, streams and bills each request (``worker.py``), its choice of
prefill rank (``dispatch.py``) and its role spec (``role.py``)."""
