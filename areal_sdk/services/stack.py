"""The ``processes`` placement: engine servers, the gateway and the rollout workers, each a
process of its own, started, watched and stopped together.

The run's own process keeps what coordinates: the rollout controller (admission by
staleness, groups, retries), the trajectory store's reader, weight pushes and the
supervision loop. The trainer is a process of its own too (``TrainProcess``); its death
stops the run, since the weights trained since the last checkpoint died with it.

```
 run process ── tasks ──► rollout workers (agents) ──► gateway process ──► engine servers
   │  controller, store, supervision            sessions (HTTP)        router: least loaded,
   │                                                                   sticky per episode
   └─ weight pushes ───────────────────────────────────────────────────► every live server
   └─ TrainProcess (trainer)
```

``supervise()`` runs every service's watch loop: the first service that fails past its
restart budget (or the trainer's death) raises ``ServiceFailed``, which stops the run with
one ``error:`` line.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_sdk.config import Config
from areal_sdk.services.health import (
    Phase,
    RestartPolicy,
    ServiceFailed,
    ServiceKind,
    ServiceState,
)

if TYPE_CHECKING:
    from areal_sdk.launcher import GatewayAddress
    from areal_sdk.plugin_host import PluginHost
    from areal_sdk.store import TrajectoryStore
    from areal_sdk.train_backend import TrainBackend

log = logging.getLogger(__name__)
TRAINER_POLL_S = 1.0


class TrainerWatch:
    """The trainer's process, seen from the run: up while it lives; its death is final."""

    def __init__(self, backend: TrainBackend) -> None:
        self.backend = backend
        pid = getattr(backend, "pid", None)
        self.state = ServiceState(kind=ServiceKind.TRAINER, name="trainer", pid=pid)
        self.state.enter(Phase.UP)

    async def watch(self, *, resume_hint: Callable[[], str]) -> None:
        failure = getattr(self.backend, "failure", None)  # ranks that name what died
        exitcode = getattr(self.backend, "exitcode", None)
        if failure is None and exitcode is None:
            return  # a trainer in this process lives and dies with it
        while True:
            if failure is not None:
                why = await asyncio.to_thread(failure)
                error = None if why is None else f"the trainer died: {why}"
            elif (code := exitcode()) is not None:
                error = f"the trainer process (pid {self.state.pid}) died with exit code {code}"
            else:
                error = None
            if error is not None:
                self.state.enter(Phase.FAILED, error)
                raise ServiceFailed("trainer", f"{error}; {resume_hint()}")
            await asyncio.sleep(TRAINER_POLL_S)


class ProcessStack:
    """Engine servers, the gateway and the rollout workers as supervised processes.

    The surface ``TrainingRun`` uses is ``LocalStack``'s: ``engine`` (the client over every
    engine server, for weight pushes), ``url``, ``sessions(run_id)``, ``runner(kwargs)``
    (where a controller runs the agent), ``supervise()`` and ``states()``.
    """

    def __init__(
        self,
        cfg: Config,
        store: TrajectoryStore,
        *,
        host: PluginHost,
        address: GatewayAddress,
        run_dir: Path,
        search_path: list[Path],
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.host = host
        self.address = address
        self.run_dir = run_dir
        self.search_path = search_path
        self.on_event = on_event or (lambda message: log.info(message))
        self.admin_token = secrets.token_urlsafe(24)
        self.policy = RestartPolicy(cfg.run.max_restarts, cfg.run.restart_window_s)
        self.url = address.url
        self.fleet: Any = None
        self.gateway: Any = None
        self.workers: Any = None
        self._forwarding: set[asyncio.Task[None]] = set()

    @property
    def engine(self) -> Any:
        return None if self.fleet is None else self.fleet.backend

    async def start(self) -> ProcessStack:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        from areal_sdk.services.agent_workers import AgentWorkerPool
        from areal_sdk.services.engine_fleet import EngineFleet
        from areal_sdk.services.gateway_process import GatewayProcess

        cfg, beat = self.cfg, self.cfg.run.heartbeat_timeout_s
        servers = cfg.inference.servers
        self.on_event(f"starting {servers} engine server{'s' if servers != 1 else ''}")
        self.fleet = EngineFleet(
            cfg,
            run_dir=self.run_dir,
            servers=servers,
            policy=self.policy,
            heartbeat_timeout_s=beat,
            on_event=self._service_event,
        )
        await asyncio.to_thread(self.fleet.start)
        urls = self.fleet.urls
        self.on_event("starting the gateway process")
        self.gateway = GatewayProcess(
            cfg,
            run_dir=self.run_dir,
            store_path=self.store.path,
            engine_urls=list(urls),
            version=self.fleet.backend.version,
            admin_token=self.admin_token,
            sock=self.address.sock,
            policy=self.policy,
            heartbeat_timeout_s=beat,
            on_event=self._service_event,
        )
        await asyncio.to_thread(self.gateway.start)
        self.url = self.gateway.url
        self.fleet.on_change = self._forward_engines
        workers = cfg.rollout.workers
        self.on_event(f"starting {workers} rollout worker{'s' if workers != 1 else ''}")
        self.workers = AgentWorkerPool(
            cfg.agent.entry or "",
            workers=workers,
            search_path=self.search_path,
            gateway_url=self.url,
            framework_telemetry=cfg.agent.framework_telemetry,
            run_dir=self.run_dir,
            heartbeat_timeout_s=beat,
            policy=self.policy,
            on_event=self.on_event,
        )
        await self.workers.start()

    def _service_event(self, _state: ServiceState, message: str) -> None:
        self.on_event(message)

    def runner(self, agent_kwargs: dict[str, Any]) -> Any:
        """Where a controller runs the agent: the worker processes, with its kwargs."""
        return self.workers.runner(agent_kwargs)

    def _forward_engines(self, urls: list[str], version: int) -> None:
        """The fleet's members changed (a restart, an added or removed server): tell the
        gateway's router. Called on the run's loop."""
        task = asyncio.get_running_loop().create_task(self._set_gateway_engines(urls, version))
        self._forwarding.add(task)
        task.add_done_callback(self._forwarding.discard)

    async def _set_gateway_engines(self, urls: list[str], version: int) -> None:
        try:
            await self.gateway.set_engines(list(urls), version)
        except Exception as exc:  # the gateway's own watch restarts it with the list
            log.warning("could not update the gateway's engine list: %s", exc)

    async def after_weight_push(self, version: int) -> None:
        """The gateway's router learns the version every live server now serves, so a
        server it took out of rotation rejoins only once it serves this version."""
        await self._set_gateway_engines(self.fleet.urls, version)

    def sessions(self, run_id: str) -> Any:
        from areal_sdk.services.http_sessions import HttpSessions

        return HttpSessions(self.url, self.admin_token, self.store, run_id=run_id)

    async def supervise(self) -> None:
        """Every service's watch loop until one fails for good (``ServiceFailed``)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.fleet.watch())
            group.create_task(self.gateway.watch())
            group.create_task(self.workers.watch())

    def states(self) -> list[ServiceState]:
        out: list[ServiceState] = []
        for part in (self.fleet, self.gateway, self.workers):
            if part is not None:
                out += part.states()
        return out

    async def add_engine(self, url: str | None = None) -> str:
        return str(await self.fleet.add(url))

    async def remove_engine(self, url: str) -> None:
        await self.fleet.remove(url)

    async def stop(self) -> None:
        """Workers first (no new calls), then the gateway, then the engines; each bounded."""
        for task in list(self._forwarding):
            task.cancel()
        if self.workers is not None:
            await self.workers.close()
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
        if self.fleet is not None:
            await asyncio.to_thread(self.fleet.stop)
