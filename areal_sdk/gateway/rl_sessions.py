"""``/rl/sessions``: open an episode, reward it, end it (the episode is stored before the reply).

``POST /rl/sessions`` needs the admin token. The other routes accept the admin token or the
session's own key; any other key sees 404, so one episode cannot even learn that another
exists. A reward must be a finite number (else 400, and nothing changes). Ending an ended
episode again answers as the first end did; an episode id is never reused (409).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from areal_sdk.gateway.errors import GatewayError, from_validation
from areal_sdk.gateway.sessions import EndedSession, Session, SessionError
from areal_sdk.gateway.state import api_key_of, gateway_of, json_body, read_json, require_admin
from areal_sdk.trajectory import EpisodeStatus

router = APIRouter(prefix="/rl")


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str | None = None
    group_id: str | None = None
    episode_id: str | None = Field(None, min_length=1, max_length=200)
    metadata: dict[str, Any] | None = None


class SetReward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float = Field(strict=True)  # a JSON number: "0.5" as a string is refused
    turn_id: str | None = None


class EndSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: EpisodeStatus = EpisodeStatus.OK
    reward: float | None = Field(None, strict=True)
    error: str | None = None
    metadata: dict[str, Any] | None = None


async def _body(request: Request, model: type[BaseModel], *, optional: bool = False) -> Any:
    if optional and not await request.body():
        return model()
    try:
        return model.model_validate(await read_json(request))
    except GatewayError:
        raise
    except Exception as exc:  # pydantic.ValidationError
        raise from_validation(exc, status=422) from exc


def _session_for(request: Request, episode_id: str) -> Session | EndedSession:
    """The session (or what is left of it once ended) if the caller is the admin or holds
    that session's key; else 404/401."""
    gw = gateway_of(request)
    key = api_key_of(request)
    found: Session | EndedSession | None = gw.sessions.by_id(episode_id) or gw.sessions.ended(
        episode_id
    )
    if gw.is_admin(key):
        if found is None:
            raise GatewayError(404, f"no session for episode {episode_id}", code="not_found")
        return found
    if key is None:
        raise GatewayError(
            401, "this route needs the admin token or the session's key", code="invalid_api_key"
        )
    mine = gw.sessions.owner_of(key)
    if mine is None:
        raise GatewayError(401, "the key is unknown", code="invalid_api_key")
    if found is None or mine is not found:
        raise GatewayError(404, f"no session for episode {episode_id}", code="not_found")
    return found


def _open_session_for(request: Request, episode_id: str) -> Session:
    session = _session_for(request, episode_id)
    if isinstance(session, EndedSession):
        raise GatewayError(409, f"episode {episode_id} has ended", code="conflict")
    return session


def _raise(exc: SessionError) -> GatewayError:
    code = {400: "invalid_value", 409: "conflict"}.get(exc.status, "not_found")
    return GatewayError(exc.status, exc.message, code=code, param=exc.param)


def _end_ack(ended: EndedSession) -> JSONResponse:
    return JSONResponse(
        {
            "id": ended.episode_id,
            "status": ended.status.value,
            "reward": ended.reward,
            "turns": ended.turns,
            "stored": True,
        }
    )


@router.post("/sessions", openapi_extra=json_body(CreateSession, required=False))
async def create_session(request: Request) -> JSONResponse:
    require_admin(request)
    req = await _body(request, CreateSession, optional=True)
    gw = gateway_of(request)
    try:
        session = gw.sessions.create(
            task_id=req.task_id,
            group_id=req.group_id,
            metadata=req.metadata,
            episode_id=req.episode_id,
        )
    except SessionError as exc:
        raise _raise(exc) from exc
    root = str(request.base_url).rstrip("/")
    ep = session.episode
    return JSONResponse(
        {
            "id": ep.id,
            "api_key": session.key,
            "task_id": ep.task_id,
            "group_id": ep.group_id,
            "openai_base_url": f"{root}/v1",
            "anthropic_base_url": root,
        }
    )


@router.get("/sessions/{episode_id}")
async def get_session(request: Request, episode_id: str) -> JSONResponse:
    session = _open_session_for(request, episode_id)
    return JSONResponse(session.episode.model_dump(mode="json"))


@router.post("/sessions/{episode_id}/reward", openapi_extra=json_body(SetReward))
async def set_reward(request: Request, episode_id: str) -> JSONResponse:
    session = _open_session_for(request, episode_id)
    req = await _body(request, SetReward)
    try:
        gateway_of(request).sessions.set_reward(session, req.reward, req.turn_id)
    except SessionError as exc:
        raise _raise(exc) from exc
    return JSONResponse({"id": episode_id, "reward": req.reward, "turn_id": req.turn_id})


@router.post("/sessions/{episode_id}/end", openapi_extra=json_body(EndSession, required=False))
async def end_session(request: Request, episode_id: str) -> JSONResponse:
    session = _session_for(request, episode_id)
    req = await _body(request, EndSession, optional=True)
    sessions = gateway_of(request).sessions
    if isinstance(session, EndedSession):  # ending twice is harmless
        return _end_ack(session)
    try:
        episode = await sessions.end(
            session, status=req.status, reward=req.reward, error=req.error, metadata=req.metadata
        )
    except SessionError as exc:
        raise _raise(exc) from exc
    except Exception as exc:  # the sink could not commit: not acknowledged, the key stays valid
        raise GatewayError(
            503,
            f"the episode could not be stored ({type(exc).__name__}: {exc})"[:500],
            code="store_unavailable",
        ) from exc
    return _end_ack(
        EndedSession(episode.id, session.key, episode.status, episode.reward, len(episode.turns))
    )
