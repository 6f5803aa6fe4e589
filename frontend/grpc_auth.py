"""Transport security of the gRPC frontend: optional TLS and bearer tokens, one per client.

With tokens configured every call but the health service's must carry the metadata
``authorization: Bearer <token>``; any other call ends with UNAUTHENTICATED before it reaches the
service. Health stays open so that load balancers and orchestrators can probe the server.

Each token names a client (:class:`ClientToken`). The client's name is its identity at the edge:
request ids are unique per client, ``Abort`` reaches only the caller's own requests, and
per-client limits count by it. Without tokens every caller is the one :data:`ANONYMOUS` client:
a per-connection identity would let anyone dodge the limits by reconnecting.

A token file holds ``name:token`` lines (blank lines and ``#`` comments skipped); a file of one
line without ``:`` is a single token, of the client ``default``. After the token a line may name,
separated by spaces::

    alice:tok-a                          private cache: a salt from its name and token
    carol:tok-c cache_salt=team-7        clients naming the same salt share cached prefixes
    ops:tok-ops admin                    ClusterStatus shows it every client's usage

Each client's cached prefixes are its own unless the file says otherwise (``cache_salt``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.kvtransfer.bind_guard import is_loopback

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ANONYMOUS = ""  # the client of every call when no token is configured
DEFAULT_CLIENT = "default"  # the client of a lone token
_CLIENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_SALT_CHARS = 256  # of a token file's cache_salt (as of a request's)


@dataclass(frozen=True)
class ClientToken:
    """A client of the token file. ``shared_salt``: the file's ``cache_salt`` (None: the client's
    cache is private); ``admin``: ``ClusterStatus`` shows it every client's usage."""

    name: str
    token: str = field(repr=False)
    shared_salt: str | None = field(default=None, repr=False)
    admin: bool = False

    @property
    def cache_salt(self) -> str:
        """The salt of this client's requests that send none (``frontend/cache_salt.py``): the
        file's shared one, else one made from its name keyed by its token, which no other
        client can name and every frontend with the same file makes alike."""
        if self.shared_salt is not None:
            return "shared:" + self.shared_salt
        key = hmac.new(self.token.encode(), b"tandem-cache-salt\0" + self.name.encode(), hashlib.sha256)
        return "private:" + key.hexdigest()


def parse_client_tokens(text: str, source: str) -> tuple[ClientToken, ...]:
    """The clients of a token file's ``text``; errors name ``source`` and the line."""
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise ValueError(f"{source}: holds no token")
    if len(lines) == 1 and ":" not in lines[0][1]:
        lines = [(lines[0][0], f"{DEFAULT_CLIENT}:{lines[0][1]}")]
    clients: list[ClientToken] = []
    for n, line in lines:
        name, sep, token = line.partition(":")
        name, token = name.strip(), token.strip()
        where = f"{source}: line {n}"
        token, *extra = token.split() or [""]
        if not sep or not token:
            raise ValueError(f"{where}: expected name:token")
        if not _CLIENT_NAME.fullmatch(name):
            raise ValueError(f"{where}: client name {name[:64]!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        if any(c.isspace() for c in token) or not token.isprintable():
            raise ValueError(f"{where}: the token of {name!r} holds a space or an unprintable character")
        if any(c.name == name for c in clients):
            raise ValueError(f"{where}: client {name!r} is listed twice")
        if any(c.token == token for c in clients):
            raise ValueError(f"{where}: the token of {name!r} is another client's too")
        clients.append(ClientToken(name, token, *_client_fields(extra, name, where)))
    return tuple(clients)


def _client_fields(fields: list[str], name: str, where: str) -> tuple[str | None, bool]:
    """A line's fields after the token: ``cache_salt=SALT`` and ``admin``, each at most once."""
    salt: str | None = None
    admin = False
    for given in fields:
        key, _, value = given.partition("=")
        if key == "cache_salt" and "=" in given:
            if salt is not None:
                raise ValueError(f"{where}: cache_salt is given twice")
            if not value:
                raise ValueError(f"{where}: cache_salt of {name!r} is empty")
            if len(value) > MAX_SALT_CHARS or not value.isprintable():
                raise ValueError(
                    f"{where}: cache_salt of {name!r} is longer than {MAX_SALT_CHARS} characters "
                    "or holds an unprintable character"
                )
            salt = value
        elif given == "admin" and not admin:
            admin = True
        else:
            raise ValueError(
                f"{where}: unknown field {given[:64]!r} after the token of {name!r}; expected "
                "cache_salt=SALT or admin (a token holds no space)"
            )
    return salt, admin


class BearerAuth:
    """Which client a call's metadata names, by its bearer token (constant time per token)."""

    def __init__(self, clients: Sequence[ClientToken]) -> None:
        if not clients or any(not c.token for c in clients):
            raise ValueError("every client needs a non-empty bearer token")
        self._expected = [(f"Bearer {c.token}".encode(), c.name) for c in clients]

    def client_of(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """The client whose token the metadata carries; ``None`` when none does."""
        given = _authorization(metadata)
        found = None
        for expected, name in self._expected:  # no early exit: the time does not tell which matched
            if hmac.compare_digest(given, expected):
                found = name
        return found


def _authorization(metadata: Sequence[tuple[str, Any]] | None) -> bytes:
    value = next((v for k, v in metadata or () if k == "authorization"), "")
    return value.encode() if isinstance(value, str) else bytes(value)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: BearerAuth) -> None:
        self._auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        if self._auth.client_of(details.invocation_metadata) is not None:
            return await continuation(details)
        handler = await continuation(details)
        why = (
            "invalid bearer token" if _authorization(details.invocation_metadata) else "missing bearer token"
        )
        return _denying(handler, why)


def _denying(handler: grpc.RpcMethodHandler | None, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # an async generator, as a streaming handler must be

    deserializer = handler.request_deserializer if handler is not None else None
    serializer = handler.response_serializer if handler is not None else None
    if handler is not None and handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, deserializer, serializer)
        return grpc.unary_stream_rpc_method_handler(deny_stream, deserializer, serializer)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_unary, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(deny_unary, deserializer, serializer)


def exposure_warning(host: str, tls: bool, auth: bool) -> str | None:
    """What is open to the network when the server binds ``host`` beyond this machine without
    TLS (tokens and prompts in plaintext) or without tokens (anyone may generate); ``None``
    on loopback or with both."""
    if is_loopback(host) or (tls and auth):
        return None
    missing = " and ".join(name for name, on in (("TLS", tls), ("bearer tokens", auth)) if not on)
    risks = ["prompts, outputs and tokens cross the network in plaintext"] if not tls else []
    risks += ["anyone who reaches the port may generate"] if not auth else []
    return f"serving on {host or 'every interface'} without {missing}: " + "; ".join(risks)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; errors name the file that cannot be read."""
    return grpc.ssl_server_credentials([(_read(key_file, "tls_key_file"), _read(cert_file, "tls_cert_file"))])


def channel_credentials(ca_file: str | None) -> grpc.ChannelCredentials:
    """TLS for a client: ``ca_file`` is the PEM of the CA (or self-signed certificate) to trust;
    ``None`` trusts the system's roots."""
    return grpc.ssl_channel_credentials(_read(ca_file, "tls_ca_file") if ca_file else None)


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror}") from None
