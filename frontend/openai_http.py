"""The OpenAI-compatible HTTP edge: a FastAPI app served by uvicorn on the frontend actor's own
event loop, beside the gRPC server, over the same :class:`FrontendCore`.

::

    POST /v1/completions, /v1/chat/completions ─▶ auth ─▶ JSON ─▶ openai_protocol (pydantic,
        GenerateSpec) ─▶ FrontendCore.generate ─▶ chunks ─▶ stop strings ─▶ JSON or SSE
    GET /v1/models, /v1/models/{id}, GET /health (200 while the frontend serves, else 503; no
        token needed)

Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): a bad field 400
naming it, a body that is not JSON (or nests deeper than ``MAX_JSON_DEPTH``) 400, a missing or
wrong bearer token 401, an unknown model or route 404, a body past the limit 413, a POST whose
``Content-Type`` is not JSON 415, the frontend or the client at its limit of running requests
429, no pool ready 503; 500 only for a bug here, with no traceback in the body. Every refusal is
counted in ``tandem_requests_total{finish_reason="rejected",code}`` by the code gRPC would give
it. Every response carries ``X-Request-Id``: the client's, when it sent a usable one, else one
made here. Tokens are ``FrontendConfig.clients``' (``grpc_auth``), sent as
``Authorization: Bearer``; the client they name scopes request ids and limits as on gRPC.

A stop string cuts every field of its choice at one token (``stop_cut.py`` states the rule):
its text, ``token_ids``, logprobs, ``usage.completion_tokens`` and ``best_of``'s ranking cover
the same tokens, those before the stop string, whatever a chunk held past it. A tool call that
``max_tokens`` (or an abort) cut short ends with that reason, not ``tool_calls``, and its text is
the content.

Invariant: a request's generator is closed when its response ends, however it ends. A stop
string aborts the request on its decode rank (its pages and the prefill rank's are freed) and the
stream ends at once; a client that goes away mid-stream or while waiting for a whole response
closes the generator, and ``FrontendCore`` aborts the request on the ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from tandem.frontend.chat_template import ChatTemplate
from tandem.frontend.core import (
    DuplicateRequest,
    FrontendCore,
    FrontendOverloaded,
    FrontendUnavailable,
)
from tandem.frontend.grpc_auth import ANONYMOUS, BearerAuth
from tandem.frontend.grpc_service import INLINE_TOKENIZE_CHARS
from tandem.frontend.openai_answers import (
    Answer,
    best_of_choices,
    merged_events,
    scored_response,
    sse_events,
)
from tandem.frontend.openai_logprobs import TokenNames
from tandem.frontend.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    Prepared,
    ServedModel,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tandem.frontend.openai_shapes import ResponseShape
from tandem.frontend.request_stream import StreamChunk
from tandem.wire.request_params import InvalidRequestError
from tandem.wire.stream_summary import StreamSummary

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a whole-response request looks for its client
MAX_JSON_DEPTH = 64  # nesting of a request body's arrays and objects; no field needs more than 4
MAX_REQUEST_ID_CHARS = 128
_TOO_DEEP = object()
# the gRPC code of each HTTP refusal, as tandem_requests_total's code label counts it
CODE_OF_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    409: "ALREADY_EXISTS",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    grace_s: float = 2.0  # running responses get this long at shutdown


def build_app(core: FrontendCore) -> FastAPI:
    """The app over ``core``: its model, its clients' tokens, its limits."""
    config = core.config
    model = ServedModel(
        config.model_name,
        core.tokenizer,
        core.model_config.vocab_size,
        core.model_config.max_position_embeddings,
        ChatTemplate.from_dir(config.model_dir),
    )
    edge = _Edge(core, BearerAuth(config.clients) if config.clients else None, model)
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)

    def refused(request: Request, status: int) -> None:
        if core.metrics is not None:  # by the client its token named, once it was checked
            client = getattr(request.state, "client", ANONYMOUS)
            core.metrics.rejected(CODE_OF_STATUS.get(status, "UNKNOWN"), client=client)

    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        if not exc.counted:
            refused(request, exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
        refused(request, exc.status_code)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
        else:
            message = str(exc.detail)
        body = OpenAIError(exc.status_code, message, "invalid_request_error").body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        refused(request, 500)
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = OpenAIError(500, "internal server error", "server_error").body()
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(OpenAIError, openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
    app.add_api_route("/health", edge.health, methods=["GET"])
    app.add_api_route("/v1/models", edge.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", edge.model_card, methods=["GET"])
    app.add_api_route("/v1/completions", edge.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", edge.chat_completions, methods=["POST"])
    return _RequestIds(app)  # type: ignore[return-value]


class _RequestIds:
    """ASGI middleware: every HTTP response carries ``X-Request-Id``, the client's when it sent
    printable ASCII of at most ``MAX_REQUEST_ID_CHARS`` characters, else a new one (the header
    the request had is what its logs can be matched by)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        usable = (
            given is not None
            and 0 < len(given) <= MAX_REQUEST_ID_CHARS
            and all(0x21 <= b <= 0x7E for b in given)
        )
        request_id = given if usable and given is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _Edge:
    """The routes' handlers over one core."""

    def __init__(self, core: FrontendCore, auth: BearerAuth | None, model: ServedModel) -> None:
        self.core = core
        self.auth = auth
        self.model = model
        self.names = TokenNames(model.tokenizer)  # tokens as logprobs name them

    async def health(self) -> JSONResponse:
        ready = self.core.ready
        return JSONResponse(
            {"status": "serving" if ready else "not serving"}, status_code=200 if ready else 503
        )

    async def models(self, request: Request) -> JSONResponse:
        self._client(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request, model_id: str) -> JSONResponse:
        """``GET /v1/models/{id}``: the served model's card, or 404 ``model_not_found``."""
        self._client(request)
        if model_id != self.model.name:
            raise OpenAIError.model_not_found(model_id, self.model.name)
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "tandem"}

    async def completions(self, request: Request) -> Response:
        arrival_s, client = time.monotonic(), self._client(request)
        parsed = parse_request(CompletionRequest, await self._json(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"

        def prepare() -> Prepared:
            return prepare_completion(parsed, self.model, request_id, client, arrival_s)

        prepared = await self._prepare(prepare, request)
        return await self._run(request, prepared, ResponseShape.of(False, request_id, self.model.name))

    async def chat_completions(self, request: Request) -> Response:
        arrival_s, client = time.monotonic(), self._client(request)
        parsed = parse_request(ChatRequest, await self._json(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        view = self.core.view
        room = view.decode_capacity_tokens if view is not None else None

        def prepare() -> Prepared:
            return prepare_chat(parsed, self.model, request_id, client, arrival_s, room)

        prepared = await self._prepare(prepare, request)
        return await self._run(request, prepared, ResponseShape.of(True, request_id, self.model.name))

    # ---- the edge ---------------------------------------------------------------------------
    def _client(self, request: Request) -> str:
        if self.auth is None:
            return ANONYMOUS
        given = request.headers.get("authorization")
        client = self.auth.client_of([("authorization", given)] if given is not None else [])
        if client is None:
            why = "invalid bearer token" if given else "missing bearer token (Authorization: Bearer ...)"
            raise OpenAIError(401, why, "invalid_request_error", None, "invalid_api_key")
        request.state.client = client  # a later refusal counts as this client's
        return client

    async def _json(self, request: Request) -> Any:
        kind = request.headers.get("content-type")
        if kind is not None and not _is_json(kind):
            raise OpenAIError.invalid(
                None, f"Content-Type {kind[:64]!r}: the body must be JSON (application/json)", 415
            )
        limit = self.core.config.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError.invalid(None, f"the body passes {limit} bytes", 413)
        # counted as it arrives: a chunked body declares no length, and is refused at the limit
        # without waiting for (or holding) the rest
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise OpenAIError.invalid(None, f"the body passes {limit} bytes", 413)
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError.invalid(None, f"the body is not JSON: {exc}") from None
        except RecursionError:  # deeper than the parser's stack: deeper than the limit too
            parsed = _TOO_DEEP
        if parsed is _TOO_DEEP or _depth_past(parsed, MAX_JSON_DEPTH):
            raise OpenAIError.invalid(None, f"the body's JSON nests deeper than {MAX_JSON_DEPTH} levels")
        return parsed

    async def _prepare(self, prepare: Callable[[], Prepared], request: Request) -> Prepared:
        """Validate and tokenise (a long body on a thread: the loop keeps the streams going)."""
        size = int(request.headers.get("content-length") or 0)
        prepared = await asyncio.to_thread(prepare) if size > INLINE_TOKENIZE_CHARS else prepare()
        guide = prepared.spec.sampling.guide
        if guide is not None:  # compiled once here, on the compiler's thread: a bad spec is a 400
            try:
                await self.core.check_guide(guide, prepared.guide_field)
            except InvalidRequestError as exc:
                raise OpenAIError.invalid(exc.field, exc.message) from None
        return prepared

    async def _admitted(
        self, prepared: Prepared
    ) -> tuple[AsyncGenerator[StreamChunk | StreamSummary, None], Any]:
        """The request's items and its first one: the frontend's refusals come before it."""
        items = self.core.generate(prepared.spec)
        try:
            first = await anext(items)
        except FrontendOverloaded as exc:
            raise OpenAIError(429, str(exc), "rate_limit_exceeded", None, "rate_limit_exceeded") from None
        except FrontendUnavailable as exc:
            raise OpenAIError(503, str(exc), "service_unavailable", None, "service_unavailable") from None
        except DuplicateRequest as exc:
            raise OpenAIError.invalid(None, str(exc), 409) from None
        except InvalidRequestError as exc:  # limits of the running pools
            field = {"prompt": "prompt", "sampling.max_tokens": "max_tokens"}.get(exc.field, exc.field)
            raise OpenAIError.invalid(field, exc.message) from None
        except BaseException:
            await items.aclose()
            raise
        return items, first

    async def _run(self, request: Request, prepared: Prepared, shape: ResponseShape) -> Response:
        if prepared.best_of > 1:
            return await self._run_choices(request, prepared, shape)
        items, first = await self._admitted(prepared)
        if prepared.stream:
            return _ClosingStreamingResponse(
                sse_events(Answer(self.core, prepared, shape, items, first, self.names)),
                items,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        whole = asyncio.ensure_future(
            scored_response(Answer(self.core, prepared, shape, items, first, self.names))
        )
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not whole.done():  # the client went away: the request ends on the ranks too
                whole.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await whole
            await items.aclose()
        if whole.cancelled():  # nobody is there to read a response
            return Response(status_code=499)
        return JSONResponse(whole.result()[0])

    async def _run_choices(self, request: Request, prepared: Prepared, shape: ResponseShape) -> Response:
        """A request for several choices (``n``, ``best_of``): one request a choice, with its own
        seed (``Prepared.choice``). The first goes alone; the rest once its first token came,
        when its prompt's pages are in its prefill rank's cache, where the router sends them."""
        choices = [prepared.choice(i) for i in range(prepared.best_of)]
        admitted = [await self._admitted(choices[0])]
        try:
            rest = await asyncio.gather(*(self._admitted(c) for c in choices[1:]), return_exceptions=True)
            failed = next((r for r in rest if isinstance(r, BaseException)), None)
            admitted += [r for r in rest if not isinstance(r, BaseException)]
            if failed is not None:
                raise failed
        except BaseException:
            for items, _ in admitted:
                await items.aclose()
            raise
        shapes = [dataclasses.replace(shape, index=i) for i in range(len(choices))]
        if prepared.stream:
            events = merged_events(
                [
                    functools.partial(sse_events, Answer(self.core, c, s, it, f, self.names))
                    for c, s, (it, f) in zip(choices, shapes, admitted, strict=True)
                ],
                prepared,
                shape,
            )
            return _ClosingStreamingResponse(
                events,
                [items for items, _ in admitted],
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        wholes = asyncio.ensure_future(
            asyncio.gather(
                *(
                    scored_response(Answer(self.core, c, s, it, f, self.names))
                    for c, s, (it, f) in zip(choices, shapes, admitted, strict=True)
                )
            )
        )
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({wholes, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not wholes.done():
                wholes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await wholes
            for items, _ in admitted:
                await items.aclose()
        if wholes.cancelled():
            return Response(status_code=499)
        return JSONResponse(best_of_choices(prepared, wholes.result()))


def _is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, whatever its parameters (``charset=utf-8``)."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _depth_past(value: Any, limit: int) -> bool:
    """Whether ``value``'s arrays and objects nest deeper than ``limit`` (walked without
    recursion: a deep body must not exhaust the stack that checks it)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))  # no scalar
    return False


class _ClosingStreamingResponse(StreamingResponse):
    """A stream that closes the request's items however the response ends (a client that went
    away cancels the response before its body iterator may have run)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        items: AsyncGenerator[Any, None] | list[AsyncGenerator[Any, None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._items = items if isinstance(items, list) else [items]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            for items in self._items:
                await items.aclose()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


# ---- the server -----------------------------------------------------------------------------
class _InLoopServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the actor's process keeps its own signal handling."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class OpenAIServer:
    """The app, served by uvicorn as a task of the running event loop."""

    def __init__(self, core: FrontendCore, config: HttpConfig) -> None:
        self.core = core
        self.config = config
        self.port = 0
        self._server: _InLoopServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    async def start(self) -> int:
        """Bind the port (an error names it) and serve; the bound port."""
        host, config = self.config.host, self.core.config
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.config.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind the HTTP port {host}:{self.config.port}: {exc.strerror}") from None
        sock.setblocking(False)
        self._socket, self.port = sock, sock.getsockname()[1]
        uv_config = uvicorn.Config(
            build_app(self.core),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=max(1, round(self.config.grace_s)),
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
        )
        self._server = _InLoopServer(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP server on {host}:{self.port} stopped at start-up")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop taking connections; running responses get ``grace_s``, then the task ends."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.config.grace_s + 5.0)
        except TimeoutError:
            self._task.cancel()
        except Exception:
            log.exception("the HTTP server ended with an error")
        if self._socket is not None:
            self._socket.close()
        self._server = self._task = self._socket = None
