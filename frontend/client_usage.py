"""Each client's totals on one frontend: requests ended, prompt tokens split cached and new, and
output tokens, from each request's bill (``ClusterStatus``' ``clients``; ``tandem client status``
adds them up over every frontend). The clients are the token file's names (at zero from the
start) and those seen, so the table is bounded by the token file."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.wire.stream_summary import StreamSummary


@dataclass
class ClientUsage:
    client: str
    requests: int = 0
    prompt_tokens: int = 0  # as the clients sent them
    cached_prompt_tokens: int = 0  # found in a prefix cache (any tier), capped at the prompt
    new_prompt_tokens: int = 0  # computed: the prompt's rest (a retry or re-prefill bills again)
    output_tokens: int = 0

    def plus(self, other: ClientUsage) -> ClientUsage:
        return ClientUsage(
            self.client,
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.cached_prompt_tokens + other.cached_prompt_tokens,
            self.new_prompt_tokens + other.new_prompt_tokens,
            self.output_tokens + other.output_tokens,
        )


class UsageBook:
    def __init__(self, clients: list[str]) -> None:
        self._by_client = {name: ClientUsage(name) for name in clients}

    def add(self, client: str, summary: StreamSummary) -> None:
        """A request of ``client`` that ended with ``summary``."""
        bill = summary.bill
        usage = self._by_client.setdefault(client, ClientUsage(client))
        usage.requests += 1
        usage.prompt_tokens += bill.prompt_tokens
        usage.cached_prompt_tokens += min(bill.cached_tokens, bill.prompt_tokens)
        usage.new_prompt_tokens += bill.new_prompt_tokens
        usage.output_tokens += len(summary.token_ids)

    def totals(self) -> tuple[ClientUsage, ...]:
        return tuple(ClientUsage(**vars(u)) for u in sorted(self._by_client.values(), key=lambda u: u.client))
