"""How a request ended, as its frontend reports it: the route it took, its tokens and text, the
bill its decode rank made and the frontend's own timings. ``Server.generate`` returns these."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import Bill, RankId
from tandem.wire.request_params import FinishReason


@dataclass(frozen=True)
class Route:
    """Where the frontend sent the request and why; ``queue_s`` (arrival -> routing started)
    and ``routing_s`` on the frontend's clock."""

    prefill_rank: RankId
    decode_rank: RankId
    predicted_cached_tokens: int
    branch: str
    queue_s: float
    routing_s: float


@dataclass(frozen=True)
class StreamSummary:
    finish_reason: FinishReason
    error: str | None
    token_ids: list[int]
    text: str
    bill: Bill  # the decode rank's
    route: Route | None
    prefill_rank: RankId | None  # where the KV was computed (a retry may differ from the route)
    decode_rank: RankId | None
    ttft_s: float  # arrival -> first token, at the frontend (0 without tokens)
    e2e_s: float  # arrival -> the result, at the frontend
    token_gaps_s: tuple[float, ...] = ()  # tokens 1.. : each one's gap on the decode rank
    # when asked for (``wire/logprobs``): each output token's (``None`` where none came), and each
    # prompt position's (``None`` first)
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()

    def latency_parts(self) -> dict[str, float]:
        """The end-to-end composition: frontend queue and routing, then the decode rank's
        pickup, reservation wait, KV wait, KV accept and decode. Each is measured on one clock;
        their sum falls short of ``e2e_s`` by the flights between processes."""
        route, bill = self.route, self.bill
        return {
            "queue": route.queue_s if route else 0.0,
            "routing": route.routing_s if route else 0.0,
            "pickup": bill.pickup_s,
            "reservation_wait": bill.reservation_wait_s,
            "kv_wait": bill.kv_wait_s,
            "kv_accept": bill.kv_accept_s,
            "decode": bill.decode_s,
        }
