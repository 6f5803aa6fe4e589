"""Decode role: the decode scheduler (pre-allocation queue, waiting-for-KV set, running batch,
preemption), the decode rank actor, and the receiving side of KV transfers. Not built yet."""
