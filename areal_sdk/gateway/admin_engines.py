"""``/rl/admin/engines``: which engine servers the gateway sends generations to.

``GET`` lists the backend's servers and the weight version it serves; ``PUT`` with
``{"servers": [url, ...], "version": N}`` replaces them (servers join and leave a running
job; a joining server must serve version ``N``). Both need the admin token. A body that is
not JSON is a 400, one of the wrong shape a 422; an engine that cannot change its servers
(the in-process embedded engine) answers 409.
"""

from __future__ import annotations

import inspect
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from areal_sdk.gateway.errors import GatewayError, from_validation
from areal_sdk.gateway.state import json_body, read_json, require_admin

router = APIRouter(prefix="/rl/admin")


class SetEngines(BaseModel):
    model_config = ConfigDict(extra="forbid")
    servers: list[str] = Field(min_length=1)
    version: int = Field(ge=0, strict=True)

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: list[str]) -> list[str]:
        for url in servers:
            try:
                parsed = httpx.URL(url)
            except (httpx.InvalidURL, TypeError) as exc:
                raise ValueError(f"{url!r} is not a URL ({exc})") from None
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise ValueError(f"{url!r} is not an http(s)://host:port URL")
        if len(set(servers)) != len(servers):
            raise ValueError("a server is listed twice")
        return [url.rstrip("/") for url in servers]


def _engine_with(request: Request, method: str) -> Any:
    engine = request.app.state.backend
    if not callable(getattr(engine, method, None)):
        raise GatewayError(
            409,
            f"this gateway's engine ({type(engine).__name__}) has a fixed set of servers; "
            "only an engine over engine servers' URLs (inference.backend=sglang) can change them",
            code="conflict",
        )
    return engine


async def _listing(engine: Any) -> JSONResponse:
    servers = engine.servers()
    if inspect.isawaitable(servers):
        servers = await servers
    return JSONResponse(
        {"servers": jsonable_encoder(servers), "version": int(getattr(engine, "version", 0))}
    )


@router.get("/engines")
async def get_engines(request: Request) -> JSONResponse:
    require_admin(request)
    return await _listing(_engine_with(request, "servers"))


@router.put("/engines", openapi_extra=json_body(SetEngines))
async def put_engines(request: Request) -> JSONResponse:
    require_admin(request)
    try:
        req = SetEngines.model_validate(await read_json(request))
    except ValidationError as exc:
        raise from_validation(exc, status=422) from exc
    engine = _engine_with(request, "set_servers")
    try:
        done = engine.set_servers(req.servers, req.version)
        if inspect.isawaitable(done):
            await done
    except ValueError as exc:  # a server that serves another version, or none left
        raise GatewayError(400, str(exc)[:500], code="invalid_value") from exc
    except ConnectionError as exc:  # a joining server that cannot be reached
        raise GatewayError(503, str(exc)[:500], code="engine_unavailable") from exc
    if callable(getattr(engine, "servers", None)):
        return await _listing(engine)
    return JSONResponse({"servers": req.servers, "version": req.version})
