"""Cache-aware router: where each request's prefill and decode run. Pure Python, no Ray.

::

    KV events (per prefill rank) ──▶ BlockIndex      hash -> ranks holding it
    route(...) ──▶ match prompt's block hashes ──▶ PrefillPolicy (cache_aware, round_robin, ...)
                                                    │  + LoadTracker (in-flight tokens per rank)
                                                    ▼
                   choose_decode_rank (free pages, in-flight requests) ──▶ RouteDecision

``router.router.Router`` is the one object a frontend holds; the other modules are its parts.
Ranks are keyed by any hashable, ordered key that prints as the rank's name (``router.rank_key``:
names, or ``wire.messages.RankId``).
"""
