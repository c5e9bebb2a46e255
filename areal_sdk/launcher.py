"""The local launcher: engine and gateway on loopback, sessions in process, clean shutdown.

The gateway runs on its own thread and event loop, so an agent that blocks (a synchronous
SDK client inside an async function, a slow tool) can never stall the server that answers
it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from areal_sdk.config import Config
from areal_sdk.gateway.sessions import SessionError
from areal_sdk.gateway.state import Gateway
from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.inference import InferenceBackend
from areal_sdk.malloc import limit_arenas
from areal_sdk.plugin_host import PluginHost, get_host
from areal_sdk.server_thread import ServerStartError, ServerThread, bind_tcp
from areal_sdk.services.health import Phase, ServiceKind, ServiceState
from areal_sdk.store import TrajectoryStore
from areal_sdk.supervisor import SupervisedEngine
from areal_sdk.tasks import SearchPath, load_agent
from areal_sdk.tracing import EpisodeContext
from areal_sdk.trajectory import Episode, EpisodeStatus

ADMIN_TOKEN_ENV = "AREAL_SDK_ADMIN_TOKEN"
log = logging.getLogger(__name__)
T = TypeVar("T")
# In-process engines that are rebuilt, with the latest weights, when they die.
SUPERVISED_BACKENDS = frozenset({"embedded"})


class LaunchError(RuntimeError):
    """A service could not start; the message says which and why."""


class RunSink:
    """The gateway's episode sink: the store, tagging each episode with its phase's run id."""

    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store

    def append(self, episode: Episode) -> None:
        self.store.append(episode, run_id=episode.metadata.get("run_id"))


@dataclass
class InProcessSessions:
    """Sessions on the gateway's own session manager, for a gateway on a thread of this
    process (a ``SessionClient``).

    The same steps as the gateway's ``/rl/sessions`` routes, without their HTTP round trips.
    In one interpreter each round trip runs the client's and the server's Python (httpx,
    anyio, uvicorn, pydantic) under the GIL that the engine and the trainer also need: in
    a profile of an asynchronous run, opening and ending sessions held it as long as the
    agents' own calls did. The work runs on the gateway's event loop, the one thread that
    owns the sessions. After ``end`` the episode is read back from the store, so what the
    trainer gets is exactly what was committed.
    """

    base_url: str | None
    gateway: Gateway
    store: TrajectoryStore
    run_id: str = "train"

    async def _on_gateway(self, work: Coroutine[Any, Any, T]) -> T:
        loop = self.gateway.loop
        if loop is None:
            raise LaunchError("the gateway has not started (no event loop)")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, loop))

    async def open(self, episode: Episode) -> str:
        episode.metadata["run_id"] = self.run_id

        async def create() -> str:
            return self.gateway.sessions.create(
                task_id=episode.task_id,
                group_id=episode.group_id,
                metadata=episode.metadata,
                episode_id=episode.id,
            ).key

        try:
            return await self._on_gateway(create())
        except SessionError as exc:
            raise LaunchError(f"gateway refused a session ({exc.status}): {exc.message}") from exc

    async def end(self, ctx: EpisodeContext) -> Episode:
        ep = ctx.episode
        sessions = self.gateway.sessions

        async def finish() -> None:
            session = sessions.by_id(ep.id)
            if session is None:
                ended = sessions.ended(ep.id)
                if ended is not None:
                    # The agent ended it (/rl/sessions/{id}/end) or it expired idle: what was
                    # stored then stands, and is read back below.
                    if ep.reward is not None and ep.reward != ended.reward:
                        log.warning(
                            "episode %s was ended before its agent returned, with reward %s; "
                            "the reward %s given after that is not used",
                            ep.id,
                            ended.reward,
                            ep.reward,
                        )
                    return
                raise SessionError(404, f"no open session for episode {ep.id}")
            for turn_id, value in ctx.turn_rewards.items():
                try:
                    sessions.set_reward(session, value, turn_id)
                except SessionError as exc:
                    log.warning("reward for episode %s not recorded: %s", ep.id, exc.message)
            await sessions.end(
                session, status=ep.status, reward=ep.reward, error=ep.error, metadata=ep.metadata
            )

        why = ""
        for attempt in range(5):
            try:
                await self._on_gateway(finish())
                return await asyncio.to_thread(self.store.get, ep.id)
            except SessionError as exc:
                why = f"{exc.status}: {exc.message}"
                break
            except Exception as exc:  # the store was busy: the session stays open, retry
                why = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.2 * 2**attempt)
        # The gateway lost the session: keep the outcome (without turns) rather than drop it.
        ep.status = EpisodeStatus.FAILED
        ep.error = ep.error or f"gateway could not end the episode ({why})"[:300]
        await asyncio.to_thread(self.store.append, ep, run_id=self.run_id)
        return ep


class GatewayAddress:
    """The gateway's socket, bound before anything heavy loads, with every usable framework
    routed to it.

    Binding first makes a port in use fail in a second rather than after the model has
    loaded; routing first lets the agent's module be imported (and build its clients, keyless,
    at import time) before the engine starts. ``LocalStack`` serves the gateway on it.
    """

    def __init__(self, cfg: Config, host: PluginHost) -> None:
        self.host = host
        name, port = cfg.inference.host, cfg.inference.port
        try:
            self.sock = bind_tcp(name, port)
        except OSError as exc:
            raise LaunchError(f"the gateway cannot bind {name}:{port}: {exc}") from exc
        bound = self.sock.getsockname()[1]
        self.url = f"http://[{name}]:{bound}" if ":" in name else f"http://{name}:{bound}"
        host.install_routing(
            GatewayRoute(self.url, framework_telemetry=cfg.agent.framework_telemetry)
        )

    def close(self) -> None:
        self.host.remove_routing()
        self.sock.close()


def open_agent(
    cfg: Config, host: PluginHost, *, search_path: SearchPath
) -> tuple[GatewayAddress, Callable[..., Any]]:
    """Bind and route the gateway's address, then import ``agent.entry``: the agent's import
    errors (a missing extra, a typo) surface in seconds, before any model loads."""
    address = GatewayAddress(cfg, host)
    try:
        return address, load_agent(cfg.agent.entry or "", search_path=search_path)
    except BaseException:
        address.close()
        raise


class LocalStack:
    """The inference engine and the gateway, in this process, on loopback.

    ``address`` is a ``GatewayAddress`` bound earlier (``open_agent``); the stack binds its
    own when given none, and closes it when it stops.
    """

    def __init__(
        self,
        cfg: Config,
        store: TrajectoryStore,
        *,
        host: PluginHost | None = None,
        on_restart: Callable[[str], None] | None = None,
        address: GatewayAddress | None = None,
    ) -> None:
        # Before the engine's and the agents' threads allocate (areal_sdk.malloc).
        limit_arenas()
        self.cfg = cfg
        self.address = address
        self.on_restart = on_restart
        self.store = store
        self.host = host or get_host()
        self.admin_token = secrets.token_urlsafe(24)
        self.engine: InferenceBackend | None = None
        self._gateway: ServerThread | None = None
        self._gateway_state: Gateway | None = None
        self.url = ""
        self._engine_state = ServiceState(kind=ServiceKind.ENGINE, name="engine")
        self._gateway_service = ServiceState(kind=ServiceKind.GATEWAY, name="gateway")

    def start(self) -> LocalStack:
        try:
            self._start()
        except BaseException:
            self.stop()  # a half-started stack leaves no engine, socket or routing behind
            raise
        return self

    def _start(self) -> None:
        from areal_sdk.gateway import create_app

        if self.address is None:
            self.address = GatewayAddress(self.cfg, self.host)
        factory = self.host.inference_backend(self.cfg.inference.backend)
        if self.cfg.inference.backend in SUPERVISED_BACKENDS:
            self.engine = SupervisedEngine(lambda: factory(self.cfg), on_restart=self.on_restart)
        else:
            self.engine = factory(self.cfg)
        app = create_app(
            self.engine,
            admin_token=self.admin_token,
            episode_sink=RunSink(self.store),
            model_name=self.cfg.model.served_name,
            tool_parser=self.cfg.inference.tool_parser,
            default_max_tokens=self.cfg.inference.max_new_tokens,
            session_idle_timeout_s=self.cfg.inference.session_idle_timeout_s,
            host=self.host,
        )
        self._gateway_state = app.state.gateway
        self._gateway = ServerThread(
            app, host=self.cfg.inference.host, sock=self.address.sock, name="gateway"
        )
        try:
            self.url = self._gateway.start()
        except ServerStartError as exc:  # the gateway failed to come up
            raise LaunchError(str(exc)) from exc
        self._engine_state.enter(Phase.UP)
        self._gateway_service.url = self.url
        self._gateway_service.enter(Phase.UP)

    def runner(self, agent_kwargs: dict[str, Any]) -> None:
        """None: the controller runs the agent in this process."""
        return None

    async def supervise(self) -> None:
        """Rebuild the engine when it dies (``SupervisedEngine``); the gateway is a thread of
        this process and lives as long as it does."""
        if isinstance(self.engine, SupervisedEngine):
            await self.engine.watch()
        else:
            await asyncio.Event().wait()

    def states(self) -> list[ServiceState]:
        if isinstance(self.engine, SupervisedEngine):
            self._engine_state.restarts = self.engine.restarts
        pid = os.getpid()
        self._engine_state.pid = self._gateway_service.pid = pid
        return [self._engine_state, self._gateway_service]

    def sessions(self, run_id: str) -> InProcessSessions:
        assert self._gateway is not None and self._gateway_state is not None, "start it first"
        return InProcessSessions(self.url, self._gateway_state, self.store, run_id=run_id)

    def stop(self) -> None:
        if self.address is not None:
            self.host.remove_routing()
        if self._gateway is not None:
            self._gateway.stop()
            self._gateway = None
        if self.address is not None:
            self.address.sock.close()  # after the server that listens on it has stopped
            self.address = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            asyncio.run(engine.close())
        self._engine_state.enter(Phase.STOPPED)
        self._gateway_service.enter(Phase.STOPPED)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def config_dir_of(path: str | Path) -> Path:
    return Path(path).resolve().parent
