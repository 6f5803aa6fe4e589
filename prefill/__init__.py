"""Prefill role: the prefill scheduler (token budget, chunking, prefix reuse), the prefill rank
actor, and the sending side of KV transfers. Not built yet."""
