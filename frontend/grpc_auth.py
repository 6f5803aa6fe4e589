"""Transport security of the gRPC frontend: optional TLS and a bearer token.

With a token configured every call but the health service's must carry the metadata
``authorization: Bearer <token>``; any other call ends with UNAUTHENTICATED before it reaches the
service. Health stays open so that load balancers and orchestrators can probe the server.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        metadata = {key: value for key, value in details.invocation_metadata or ()}
        given = metadata.get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        why = "missing bearer token" if not given else "invalid bearer token"
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
