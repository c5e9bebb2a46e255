"""Rollout workers on a Ray cluster: each an actor that imports the user's agent once and
runs the episodes it is sent, with every framework routed to the run's gateway.

``RayWorkerPool`` is the ``AgentWorkerPool`` of ``run.placement: ray``: the rollout
controller opens each episode's gateway session in the run's process, the pool runs the
agent in the least loaded live actor, and puts what the agent did back on the episode
(``agent_worker.request_of`` / ``apply_outcome``, the same wire format). An actor that dies
(or whose node leaves) fails the episodes it was running alone (``RayActorError``; the
controller's ``rollout.retries`` re-run them); ``watch()`` pings every actor and replaces a
dead or silent one within ``run.heartbeat_timeout_s``, until the restart policy gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from areal_sdk.launcher import LaunchError
from areal_sdk.services.agent_workers import _BoundRunner
from areal_sdk.services.health import Phase, RestartPolicy, ServiceKind, ServiceState
from areal_sdk.services.ray_placement import NodeInfo, RayPlacement, first_line
from areal_sdk.tracing import EpisodeContext

log = logging.getLogger(__name__)


@ray.remote
class RolloutActor:
    """The user's agent on one node; async, so its episodes run side by side."""

    def __init__(
        self,
        entry: str,
        search_path: list[str],
        gateway_url: str,
        framework_telemetry: bool,
        log_path: str,
    ) -> None:
        from areal_sdk.hookspecs import GatewayRoute
        from areal_sdk.services.agent_worker import _adapter_host
        from areal_sdk.tasks import load_agent

        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        logging.basicConfig(
            filename=log_path, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
        )
        self.agent: Any = None
        self.error: str | None = None
        try:
            # Routing first: an agent module may build its clients at import.
            _adapter_host().install_routing(
                GatewayRoute(gateway_url, framework_telemetry=framework_telemetry)
            )
            self.agent = load_agent(entry, search_path=[Path(p) for p in search_path])
        except Exception as exc:
            self.error = " ".join(str(exc).split()) or type(exc).__name__
            log.error("cannot load the agent %s: %s", entry, self.error)

    async def ready(self) -> dict[str, Any]:
        node = NodeInfo.here()
        return {"error": self.error, "pid": os.getpid(), "node_id": node.node_id, "ip": node.ip}

    async def ping(self) -> None:
        """Answers while the actor's event loop turns (sync agents run on threads)."""

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        from areal_sdk.rollout import InProcessRunner
        from areal_sdk.services.agent_worker import context_of, outcome_of

        ctx = context_of(request)
        runner = InProcessRunner(self.agent, request["agent_kwargs"])
        result, error = await runner.call(request["task"], ctx, timeout_s=request["timeout_s"])
        return outcome_of(result, error, ctx)


class _Worker:
    """One actor as the pool sees it; replaced whole when it dies."""

    def __init__(self, index: int, state: ServiceState, actor: Any) -> None:
        self.index = index
        self.label = f"rollout worker {index}"
        self.state = state
        self.actor = actor
        self.ready: ray.ObjectRef = actor.ready.remote()
        self.spawned = time.monotonic()
        self.in_flight = 0
        self.dispatched = 0
        self.lost: str | None = None  # why it died, seen by a call

    @property
    def live(self) -> bool:
        return self.state.phase == Phase.UP and self.lost is None


class RayWorkerPool:
    """``workers`` rollout worker actors running the agent ``entry`` (module docstring)."""

    def __init__(
        self,
        entry: str,
        *,
        workers: int,
        placement: RayPlacement,
        search_path: list[Path],
        gateway_url: str,
        framework_telemetry: bool,
        run_dir: Path,
        heartbeat_timeout_s: float,
        policy: RestartPolicy,
        on_event: Callable[[str], None],
        start_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"rollout.workers must be at least 1, got {workers}")
        self.entry = entry
        self.placement = placement
        self.search_path = [str(Path(p).resolve()) for p in search_path]
        self.gateway_url = gateway_url
        self.framework_telemetry = framework_telemetry
        self.log_dir = Path(run_dir) / "services"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.policy = policy
        self.on_event = on_event
        self.start_timeout_s = start_timeout_s
        self.nodes: dict[str, NodeInfo] = {}
        self._poll_s = min(1.0, heartbeat_timeout_s / 4)
        self._states = [
            ServiceState(kind=ServiceKind.ROLLOUT_WORKER, name=f"rollout-worker-{i}")
            for i in range(workers)
        ]
        self._workers: list[_Worker] = []
        self._up = asyncio.Event()
        self._wake = asyncio.Event()
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every actor and wait until each has imported the agent; ``LaunchError``
        with the reason when one cannot."""
        try:
            self._workers = [self._spawn(i) for i in range(len(self._states))]
            for w in self._workers:
                why = await self._await_ready(w)
                if why is not None:
                    raise LaunchError(f"{w.label} {why} (log: {self._log_path(w.index)})")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Kill every actor; episodes still running fail alone."""
        self._closing = True
        self._wake.set()
        workers, self._workers = self._workers, []
        for w in workers:
            with contextlib.suppress(Exception):
                ray.kill(w.actor, no_restart=True)
            w.state.enter(Phase.STOPPED)

    def states(self) -> list[ServiceState]:
        return list(self._states)

    async def watch(self) -> None:
        """Replace dead and silent actors until ``close()``; raises ``ServiceFailed`` when
        one fails more often than the restart policy allows."""
        while not self._closing:
            self._wake.clear()
            faults = await asyncio.gather(*(self._fault(w) for w in list(self._workers)))
            for w, why in zip(list(self._workers), faults, strict=True):
                if why is not None and not self._closing:
                    await self._replace(w, why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)

    # -- episodes ----------------------------------------------------------------------------

    def runner(self, agent_kwargs: dict[str, Any] | None = None) -> _BoundRunner:
        return _BoundRunner(self, dict(agent_kwargs or {}))

    async def call(
        self,
        task: Any,
        ctx: EpisodeContext,
        *,
        timeout_s: float,
        agent_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Any, str | None]:
        """Run the agent on ``task`` in the least loaded live actor (``AgentRunner.call``)."""
        from areal_sdk.services.agent_worker import apply_outcome, request_of

        worker = await self._pick(timeout_s)
        if worker is None:
            return None, "no rollout worker is up; episode failed"
        request = request_of(task, ctx, agent_kwargs or {}, timeout_s)
        try:
            ref = worker.actor.run.remote(request)
        except Exception as exc:  # a task Ray cannot serialize fails its episode alone
            return None, f"the task cannot be sent to a rollout worker: {type(exc).__name__}: {exc}"
        worker.in_flight += 1
        worker.dispatched += 1
        # The actor times the agent out itself; this bound covers one that never answers.
        bound = timeout_s + max(self.heartbeat_timeout_s, 5.0)
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(ref.future()), bound)
        except RayActorError as exc:
            worker.lost = worker.lost or f"died ({first_line(exc)})"
            self._wake.set()
            return None, f"{worker.label} {worker.lost}; episode failed"
        except RayError as exc:
            return None, f"{worker.label} failed the episode: {first_line(exc)}"
        except TimeoutError:
            ray.cancel(ref)
            return None, f"{worker.label} did not answer within {bound:g} s; episode failed"
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        finally:
            worker.in_flight -= 1
        return apply_outcome(ctx, outcome)

    async def _pick(self, within_s: float) -> _Worker | None:
        deadline = time.monotonic() + within_s
        while not self._closing:
            live = [w for w in self._workers if w.live]
            if live:
                return min(live, key=lambda w: (w.in_flight, w.dispatched))
            self._up.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), left)
        return None

    # -- supervision -------------------------------------------------------------------------

    async def _fault(self, w: _Worker) -> str | None:
        if w.lost is not None:
            return w.lost
        if w.state.phase != Phase.UP:
            return None  # starting: _await_ready bounds it
        try:
            ping = asyncio.wrap_future(w.actor.ping.remote().future())
            await asyncio.wait_for(ping, self.heartbeat_timeout_s)
        except RayActorError as exc:
            return f"died ({first_line(exc)})"
        except TimeoutError:
            return f"stalled (no answer for {self.heartbeat_timeout_s:g} s)"
        except RayError as exc:
            return f"failed ({first_line(exc)})"
        return None

    async def _replace(self, w: _Worker, why: str) -> None:
        w.state.enter(Phase.RESTARTING)  # no new episode goes to it
        self._event(f"{w.label} {why}; restarting it")
        with contextlib.suppress(Exception):
            ray.kill(w.actor, no_restart=True)  # its running episodes fail alone
        self.policy.record_failure(w.state, f"{w.label} {why}")  # raises past the budget
        fresh = self._workers[w.index] = self._spawn(w.index)
        task = asyncio.create_task(self._come_up(fresh))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _come_up(self, w: _Worker) -> None:
        why = await self._await_ready(w)
        if why is not None and self._workers[w.index] is w:
            w.lost = why  # the watch counts it and tries again
            self._wake.set()

    async def _await_ready(self, w: _Worker) -> str | None:
        """None once ``w`` imported the agent (it is then up); else why it cannot."""
        try:
            answer = await asyncio.wait_for(
                asyncio.wrap_future(w.ready.future()), self.start_timeout_s
            )
        except TimeoutError:
            resources = self.placement.resources("worker")
            return f"did not start within {self.start_timeout_s:g} s (it asks Ray for {resources})"
        except RayError as exc:
            return f"could not start: {first_line(exc)}"
        if answer["error"] is not None:
            return f"cannot load the agent: {answer['error']}"
        node = NodeInfo(answer["node_id"], answer["ip"])
        self.nodes[w.state.name] = node
        w.state.pid = int(answer["pid"])
        w.state.enter(Phase.UP)
        self._event(f"{w.label} runs on {node}")
        self._up.set()
        return None

    def _spawn(self, index: int) -> _Worker:
        state = self._states[index]
        state.pid = None
        state.enter(Phase.STARTING)
        actor = RolloutActor.options(**self.placement.options("worker", index)).remote(
            self.entry,
            self.search_path,
            self.gateway_url,
            self.framework_telemetry,
            str(self._log_path(index)),
        )
        return _Worker(index, state, actor)

    def _log_path(self, index: int) -> Path:
        return self.log_dir / f"{self._states[index].name}.log"

    def _event(self, message: str) -> None:
        try:
            self.on_event(message)
        except Exception:  # a display's bug must not stop the supervision
            log.exception("the rollout workers' event callback failed")
