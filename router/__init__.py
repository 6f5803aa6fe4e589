"""Cache-aware router: a block-hash index per prefill rank fed by KV events, load tracking, and
the prefill and decode choice. Pure Python, testable without Ray. Not built yet."""
