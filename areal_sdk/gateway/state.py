"""What every route needs: the gateway's state, caller authentication, body parsing, SSE.

The API key of a call is read from ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (the
OpenAI and Anthropic SDKs send one each). An episode key ties the call to its session; the
admin token is accepted too, for calls that belong to no episode (nothing is recorded); any
other key is a 401 in the caller's format.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from areal_sdk.gateway.errors import ApiFlavor, GatewayError, from_validation
from areal_sdk.gateway.generation import Generator
from areal_sdk.gateway.json_input import loads_checked
from areal_sdk.gateway.metrics import GatewayMetrics
from areal_sdk.gateway.sessions import Session, SessionManager

M = TypeVar("M", bound=BaseModel)

# Turn metadata a client sends with a call (plugins/_routing.py sets it from framework hooks).
METADATA_HEADER = "x-areal-metadata"


@dataclass
class Gateway:
    generator: Generator
    sessions: SessionManager
    metrics: GatewayMetrics
    admin_token: str
    model_name: str
    created: int = 0
    # The event loop serving the app (set at startup): in-process callers run session
    # changes on it, the one thread that owns the session manager.
    loop: asyncio.AbstractEventLoop | None = None

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def is_admin(self, key: str | None) -> bool:
        return key is not None and hmac.compare_digest(key.encode(), self.admin_token.encode())


@dataclass
class Caller:
    """Who made a call: an episode's session, or the admin (no session)."""

    session: Session | None
    admin: bool = False


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def api_key_of(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    key = request.headers.get("x-api-key", "").strip()
    return key or None


def authenticate(request: Request, flavor: ApiFlavor) -> Caller:
    gw = gateway_of(request)
    key = api_key_of(request)
    if key is None:
        raise GatewayError(
            401,
            "You didn't provide an API key. Use the episode key (or the admin "
            "token) as the API key.",
            code="invalid_api_key",
        )
    if gw.is_admin(key):
        return Caller(session=None, admin=True)
    session = gw.sessions.by_key(key)
    if session is None:
        raise GatewayError(
            401,
            "Incorrect API key provided: the key is unknown or its episode has ended.",
            code="invalid_api_key",
        )
    return Caller(session=session)


def require_admin(request: Request) -> None:
    if not gateway_of(request).is_admin(api_key_of(request)):
        raise GatewayError(401, "this route needs the admin token", code="invalid_api_key")


@asynccontextmanager
async def in_call(gw: Gateway, caller: Caller) -> AsyncIterator[None]:
    """Counts the call as in flight, so ending its session waits for its turn."""
    if caller.session is None:
        yield
        return
    gw.sessions.begin_call(caller.session)
    try:
        yield
    finally:
        gw.sessions.end_call(caller.session)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = loads_checked(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(
            400, "We could not parse the JSON body of your request.", code="invalid_json"
        ) from exc
    except ValueError as exc:
        raise GatewayError(
            400, f"We could not use the JSON body of your request: {exc}.", code="invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise GatewayError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def parse(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from exc


class LiveStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` when it ends, however it ends
    (finished, client gone, server stopping), so a live generation is stopped and recorded."""

    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close()


SseEvents = Iterable[tuple[str | None, Any]] | AsyncIterable[tuple[str | None, Any]]


def sse(
    events: SseEvents,
    *,
    done: bool,
    on_close: Callable[[], Awaitable[None]] | None = None,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """Server-sent events: ``(event name or None, JSON payload)`` pairs, then ``[DONE]``."""

    def encode(name: str | None, payload: Any) -> bytes:
        head = f"event: {name}\n" if name else ""
        return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    async def body() -> AsyncIterator[bytes]:
        if isinstance(events, AsyncIterable):
            async for name, payload in events:
                yield encode(name, payload)
        else:
            for name, payload in events:
                yield encode(name, payload)
        if done:
            yield b"data: [DONE]\n\n"

    all_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    if on_close is None:
        return StreamingResponse(body(), media_type="text/event-stream", headers=all_headers)
    return LiveStreamingResponse(
        body(), media_type="text/event-stream", headers=all_headers, on_close=on_close
    )


def call_metadata(request: Request) -> dict[str, Any]:
    """The client's turn metadata from the ``x-areal-metadata`` header (a JSON object)."""
    raw = request.headers.get(METADATA_HEADER)
    if raw is None or not raw.strip():
        return {}
    try:
        value = loads_checked(raw)
    except json.JSONDecodeError as exc:
        raise GatewayError(
            400,
            f"The {METADATA_HEADER} header is not valid JSON: {exc.msg}.",
            param=METADATA_HEADER,
            code="invalid_metadata",
        ) from exc
    except ValueError as exc:
        raise GatewayError(
            400,
            f"The {METADATA_HEADER} header cannot be used: {exc}.",
            param=METADATA_HEADER,
            code="invalid_metadata",
        ) from exc
    if not isinstance(value, dict):
        raise GatewayError(
            400,
            f"The {METADATA_HEADER} header must be a JSON object, got {type(value).__name__}.",
            param=METADATA_HEADER,
            code="invalid_metadata",
        )
    return value


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` declaring a route's JSON body (routes read the raw body themselves,
    to answer errors in their API's own shape), so the OpenAPI document is complete."""

    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }
