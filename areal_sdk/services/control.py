"""The run's control endpoint: what ``areal-sdk status`` and ``areal-sdk engines`` talk to.

A live run serves, on loopback, ``GET /health``, ``GET /services`` (every service's state),
``GET /metrics`` (Prometheus: each service's phase and restarts) and, where the placement has
engine servers of its own, ``POST /engines`` (add one: launch it, or attach ``{"url": ...}``)
and ``DELETE /engines`` (``{"url": ...}``: drain it, then stop it). Its address and token are
in ``<run_dir>/services.json`` (mode 0600), which the run rewrites as it ends, with
``"live": false`` and the services' last states.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from areal_sdk.services.health import Phase, ServiceState

SERVICES_FILENAME = "services.json"
ENGINE_CHANGE_TIMEOUT_S = 600.0

States = Callable[[], list[ServiceState]]
AddEngine = Callable[[str | None], Awaitable[str]]
RemoveEngine = Callable[[str], Awaitable[None]]


def _metrics(states: list[ServiceState]) -> bytes:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    up = Gauge("areal_service_up", "1 while the service is up", ["kind", "name"], registry=registry)
    restarts = Gauge(
        "areal_service_restarts", "restarts of the service", ["kind", "name"], registry=registry
    )
    for s in states:
        up.labels(s.kind, s.name).set(1.0 if s.phase == Phase.UP else 0.0)
        restarts.labels(s.kind, s.name).set(float(s.restarts))
    return bytes(generate_latest(registry))


def create_control_app(
    *,
    token: str,
    placement: str,
    states: States,
    loop: asyncio.AbstractEventLoop,
    add_engine: AddEngine | None = None,
    remove_engine: RemoveEngine | None = None,
) -> Any:
    """The control routes; engine changes run on the run's own ``loop``."""
    app = FastAPI(title="areal-sdk run control", docs_url=None, redoc_url=None)

    def refused(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    def authorized(request: Request) -> bool:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return secrets.compare_digest(given, token)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "placement": placement}

    @app.get("/services")
    def services(request: Request) -> Any:
        if not authorized(request):
            return refused(401, "the run's control token is required (services.json)")
        return {"placement": placement, "services": [s.as_dict() for s in states()]}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(_metrics(states()), media_type="text/plain; version=0.0.4")

    async def on_run_loop(work: Awaitable[Any]) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(work, loop)  # type: ignore[arg-type]
        return await asyncio.wait_for(asyncio.wrap_future(future), ENGINE_CHANGE_TIMEOUT_S)

    async def body_url(request: Request, required: bool) -> str | None:
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            raise ValueError('the body must be JSON: {"url": "http://host:port"}') from None
        url = body.get("url") if isinstance(body, dict) else None
        if url is not None and (not isinstance(url, str) or not url.startswith("http")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        if required and url is None:
            raise ValueError('give the engine server\'s url: {"url": "http://host:port"}')
        return url

    @app.post("/engines")
    async def add(request: Request) -> Any:
        if not authorized(request):
            return refused(401, "the run's control token is required (services.json)")
        if add_engine is None:
            return refused(409, f"placement {placement} has no engine servers to add to")
        try:
            url = await body_url(request, required=False)
        except ValueError as exc:
            return refused(400, str(exc))
        try:
            added = await on_run_loop(add_engine(url))
        except Exception as exc:
            return refused(502, f"could not add the engine server: {exc}")
        return {"url": added}

    @app.delete("/engines")
    async def remove(request: Request) -> Any:
        if not authorized(request):
            return refused(401, "the run's control token is required (services.json)")
        if remove_engine is None:
            return refused(409, f"placement {placement} has no engine servers to remove")
        try:
            url = await body_url(request, required=True)
            assert url is not None
            await on_run_loop(remove_engine(url))
        except ValueError as exc:
            return refused(400, str(exc))
        except LookupError as exc:  # the fleet has no server at that url
            return refused(404, str(exc.args[0]) if exc.args else "no such engine server")
        except Exception as exc:
            return refused(502, f"could not remove the engine server: {exc}")
        return {"removed": url}

    return app


class ControlServer:
    """The control app on a loopback thread, announced in ``services.json``."""

    def __init__(
        self,
        run_dir: Path,
        *,
        placement: str,
        states: States,
        add_engine: AddEngine | None = None,
        remove_engine: RemoveEngine | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.placement = placement
        self.states = states
        self.add_engine = add_engine
        self.remove_engine = remove_engine
        self.token = secrets.token_urlsafe(24)
        self.path = run_dir / SERVICES_FILENAME
        self._server: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> str:
        from areal_sdk.server_thread import ServerThread

        app = create_control_app(
            token=self.token,
            placement=self.placement,
            states=self.states,
            loop=loop,
            add_engine=self.add_engine,
            remove_engine=self.remove_engine,
        )
        self._server = ServerThread(app, name="control")
        url = self._server.start()
        self._write({"live": True, "url": url, "token": self.token})
        return url

    def _write(self, fields: dict[str, Any]) -> None:
        record = {"pid": os.getpid(), "placement": self.placement, "updated": time.time()}
        staging = self.path.with_suffix(".json.partial")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**record, **fields}, f, indent=2)
        staging.replace(self.path)

    def stop(self, final: list[ServiceState] | None = None) -> None:
        """Stop serving and record the services' last states (``final``: those the run had
        before it stopped them, when stopping takes them out of ``states()``)."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        states = self.states() if final is None else final
        self._write({"live": False, "services": [s.as_dict() for s in states]})


def read_services_file(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SERVICES_FILENAME
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{run_dir} has no {SERVICES_FILENAME}: no run has started there"
        ) from None
