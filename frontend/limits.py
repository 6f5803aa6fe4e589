"""The operator's limits at the gRPC edge: how much one client may run, how large a request may be,
how long connections live, how often a stream's tokens go out, and how long a structured
output's grammar may take to compile.

Limits that follow from the model (prompt and output lengths within its context, stop ids within
its vocabulary) are not settings: ``grpc_service`` derives them from the model's config.

Connections: the server pings a connection every ``keepalive_time_s`` and closes it when no
answer comes within ``keepalive_timeout_s`` (a client that vanished without a FIN does not hold
its streams for hours); a connection with no call for ``max_connection_idle_s`` is closed
(GOAWAY; the client reconnects on its next call); with ``max_connection_age_s`` a connection is
closed after that long, its calls given ``max_connection_age_grace_s`` to finish (load
balancers then see clients move). A client may ping at most every ``min_ping_interval_s`` while
no call runs; faster pings end its connection.
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2**31 - 1  # gRPC's "infinite" for millisecond options


@dataclass(frozen=True)
class EdgeLimits:
    max_requests_per_client: int | None = None  # streams one client may run at once; None: no cap
    max_request_bytes: int = 4 * 1024 * 1024  # a larger request: RESOURCE_EXHAUSTED from gRPC
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    max_connection_idle_s: float | None = 900.0  # None: idle connections stay open
    max_connection_age_s: float | None = None  # None: connections are not recycled
    max_connection_age_grace_s: float = 300.0
    min_ping_interval_s: float = 10.0
    # a stream's message goes to its client once it holds this many new tokens (the first token
    # and the end go at once): fewer, larger messages for a frontend that serves many streams
    stream_interval: int = 1
    # a structured output's grammar compiles within this, or the request is refused naming its
    # field (a typical schema takes milliseconds; the client waits for the check)
    grammar_compile_limit_s: float = 10.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        if self.max_requests_per_client is not None and self.max_requests_per_client < 1:
            raise ValueError(
                f"max_requests_per_client: must be at least 1, got {self.max_requests_per_client}"
            )
        if not 1024 <= self.max_request_bytes <= INT32_MAX:
            raise ValueError(
                f"max_request_bytes: must be in [1024, {INT32_MAX}], got {self.max_request_bytes}"
            )
        if not 1 <= self.stream_interval <= 1024:
            raise ValueError(f"stream_interval: must be in [1, 1024], got {self.stream_interval}")
        for name in (
            "keepalive_time_s",
            "keepalive_timeout_s",
            "max_connection_idle_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
            "min_ping_interval_s",
            "grammar_compile_limit_s",
        ):
            value = getattr(self, name)
            if value is not None and not 0 < value * 1000 <= INT32_MAX:
                raise ValueError(f"{name}: must be > 0 and at most {INT32_MAX // 1000} s, got {value}")

    def server_options(self) -> list[tuple[str, int]]:
        """The ``grpc.aio.server`` channel arguments these limits set."""
        return [
            ("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(self.min_ping_interval_s)),
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.max_connection_idle_ms", _ms(self.max_connection_idle_s)),
            ("grpc.max_connection_age_ms", _ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(self.max_connection_age_grace_s)),
        ]


def _ms(seconds: float | None) -> int:
    return INT32_MAX if seconds is None else max(1, min(INT32_MAX, round(seconds * 1000)))
