"""The gateway's ASGI app: ``create_app(backend, tokenizer, admin_token=..., episode_sink=...)``.

>>> from areal_sdk.gateway import create_app           # doctest: +SKIP
>>> app = create_app(engine, engine.tokenizer, admin_token="secret", episode_sink=store)
>>> uvicorn.run(app, host="127.0.0.1", port=8321)

Routes: OpenAI ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/models``; Anthropic ``/v1/messages``; sessions under ``/rl/sessions``; ``/health`` and
``/metrics``. Errors come back in the caller's API's format (``errors.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from areal_sdk.disconnect import CancelOnDisconnect
from areal_sdk.gateway import (
    admin_engines,
    anthropic_messages,
    openai_chat,
    openai_completions,
    openai_responses,
    rl_sessions,
)
from areal_sdk.gateway.errors import GatewayError, error_response, flavor_of, from_validation
from areal_sdk.gateway.generation import Generator
from areal_sdk.gateway.metrics import GatewayMetrics
from areal_sdk.gateway.sessions import EpisodeSink, SessionManager
from areal_sdk.gateway.state import Gateway, authenticate, gateway_of
from areal_sdk.gateway.templating import PromptBuilder
from areal_sdk.gateway.tool_parsers import ToolCallParser, default_parser_name
from areal_sdk.inference import InferenceBackend

log = logging.getLogger("areal_sdk.gateway")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_SESSION_IDLE_TIMEOUT_S = 3600.0


class _BodyLimit:
    """413 for bodies over the limit, whether announced by Content-Length or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = GatewayError(
            413,
            f"Request body is larger than the limit of {self.limit} bytes.",
            code="request_too_large",
        )
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await error_response(flavor_of(scope["path"]), too_big)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_big
            return message

        await self.app(scope, limited, send)


class _Metrics:
    """Requests by route template and status, and latency, for every HTTP call."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except asyncio.CancelledError:
            status = 499  # the client left before the answer (CancelOnDisconnect)
            raise
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


def _resolve_parser(
    tool_parser: str | ToolCallParser | None, template: str, host: Any
) -> ToolCallParser:
    if callable(tool_parser):
        return tool_parser
    if host is None:
        from areal_sdk.plugin_host import get_host

        host = get_host()
    parsers = host.tool_call_parsers()
    name = tool_parser or default_parser_name(template)
    if name not in parsers:
        known = ", ".join(sorted(parsers)) or "none (is the gateway plugin registered?)"
        raise ValueError(f"no tool-call parser named {name!r}; known: {known}")
    return parsers[name]


def create_app(
    backend: InferenceBackend,
    tokenizer: Any = None,
    *,
    admin_token: str,
    episode_sink: EpisodeSink | None = None,
    model_name: str | None = None,
    tool_parser: str | ToolCallParser | None = None,
    chat_template: str | None = None,
    max_model_len: int | None = None,
    default_max_tokens: int = 512,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    session_idle_timeout_s: float | None = DEFAULT_SESSION_IDLE_TIMEOUT_S,
    host: Any = None,
) -> FastAPI:
    """Build the gateway over ``backend``.

    ``tokenizer`` defaults to ``backend.tokenizer``. Finished episodes go to
    ``episode_sink.append(episode)`` (e.g. a ``TrajectoryStore``) before ``/end`` answers.
    ``tool_parser`` is a parser name registered through the ``areal_tool_call_parsers`` hook
    (default: picked from the chat template) or a parser function. ``host`` is the plugin host
    (default: the process-wide one); it also gets the ``areal_turn_recorded`` and
    ``areal_episode_ended`` events. A session with no call for ``session_idle_timeout_s``
    (None: never) is ended as failed and stored.
    """
    if not admin_token:
        raise ValueError("admin_token must be a non-empty string")
    tokenizer = tokenizer if tokenizer is not None else backend.tokenizer
    if tokenizer is None:
        raise ValueError("a tokenizer is needed (pass one, or use a backend that has .tokenizer)")
    builder = PromptBuilder(tokenizer, chat_template)
    # The engine's own stop ids (generation_config may list several) also end a turn.
    builder.end_ids |= {int(i) for i in getattr(backend, "eos_ids", None) or ()}
    if max_model_len is None:
        max_model_len = getattr(backend, "max_model_len", None)
        tok_max = getattr(tokenizer, "model_max_length", None)
        max_model_len = max_model_len or (
            tok_max if isinstance(tok_max, int) and tok_max < 10**7 else 4096
        )
    if host is None:
        from areal_sdk.plugin_host import get_host

        host = get_host()
    parser = _resolve_parser(tool_parser, builder.template, host)
    metrics = GatewayMetrics()
    sessions = SessionManager(episode_sink, metrics, host, idle_timeout_s=session_idle_timeout_s)
    generator = Generator(
        backend,
        builder,
        parser,
        sessions,
        metrics,
        max_model_len=int(max_model_len),
        default_max_tokens=default_max_tokens,
    )
    app = FastAPI(
        title="areal-sdk gateway",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        lifespan=_lifespan,
    )
    app.state.gateway = Gateway(
        generator=generator,
        sessions=sessions,
        metrics=metrics,
        admin_token=admin_token,
        model_name=model_name or getattr(backend, "model_name", None) or "policy",
    )
    app.state.backend = backend
    _install_handlers(app, metrics)
    for module in (
        openai_chat,
        openai_completions,
        openai_responses,
        anthropic_messages,
        rl_sessions,
        admin_engines,
    ):
        app.include_router(module.router)
    _install_info_routes(app)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.add_middleware(_Metrics, metrics=metrics)
    # Outermost: a client that leaves cancels its generation, which aborts it in the engine.
    app.add_middleware(CancelOnDisconnect)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Remembers the serving loop and reaps idle sessions while the app runs."""
    gw: Gateway = app.state.gateway
    gw.loop = asyncio.get_running_loop()
    reaper = asyncio.create_task(gw.sessions.reap_forever(), name="areal-session-reaper")
    try:
        yield
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)


def _install_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    def respond(request: Request, err: GatewayError) -> JSONResponse:
        metrics.errors.labels(err.code or str(err.status)).inc()
        return error_response(flavor_of(request.url.path), err)

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        status = 422 if request.url.path.startswith("/rl/") else 400
        return respond(request, from_validation(exc, status=status))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (
            f"Unknown route: {request.method} {request.url.path}"
            if exc.status_code == 404
            else str(exc.detail)
        )
        return respond(request, GatewayError(exc.status_code, message, code=code))

    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        # The caller left before its body arrived (an episode cancelled at shutdown): nothing
        # was done and nobody reads the answer, so it is no server error.
        log.debug("client left during %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return respond(
            request,
            GatewayError(
                500, "The server had an error while processing your request.", code="internal_error"
            ),
        )


def _install_info_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        gw = gateway_of(request)
        try:
            engine = await request.app.state.backend.health()
        except Exception as exc:
            return JSONResponse(
                {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"[:500]},
                status_code=503,
            )
        return JSONResponse(
            {"status": "ok", "model": gw.model_name, "sessions": len(gw.sessions), "engine": engine}
        )

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(gateway_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(request: Request, model_id: str) -> dict[str, Any]:
        gw = gateway_of(request)
        if "anthropic-version" in request.headers:
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(gw.created))
            return {
                "type": "model",
                "id": model_id,
                "display_name": model_id,
                "created_at": created,
            }
        return {"id": model_id, "object": "model", "created": gw.created, "owned_by": "areal-sdk"}

    def _check_key(request: Request) -> None:
        authenticate(request, flavor_of(request.url.path))

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        _check_key(request)
        card = model_card(request, gateway_of(request).model_name)
        if "anthropic-version" in request.headers:
            return JSONResponse(
                {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
            )
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> JSONResponse:
        # Any model name is served by the policy, so every id exists.
        _check_key(request)
        return JSONResponse(model_card(request, model_id))
