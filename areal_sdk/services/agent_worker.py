"""One rollout worker: a process that runs the user's agent for ``AgentWorkerPool``.

Started as ``python -m areal_sdk.services.agent_worker`` with one end of a socket pair
(``--fd``). It routes every usable framework to the gateway, imports the agent, says
``ready`` (or why the import failed), then runs the episodes it is sent: async agents on
its event loop, sync agents on threads that a timeout abandons (``InProcessRunner``). A
thread beats the heartbeat every ``--heartbeat-s`` seconds, whatever the agents do.

The wire format is pickled tuples, built and read by the functions below on both sides:

- parent to worker: ``("call", call_id, request)``, ``("cancel", call_id)``
- worker to parent: ``("beat",)``, ``("ready", pid)``, ``("error", message)``,
  ``("done", call_id, outcome)``

The worker dies with its parent: the socket is its lifeline (``services/lifeline.py``). Once
the parent's end closes, however the parent died, the worker kills its own process group, so
the agent's children go too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from areal_sdk.services.child_logging import configure_service_logging

if TYPE_CHECKING:
    from areal_sdk.plugin_host import PluginHost
    from areal_sdk.tracing import EpisodeContext

log = logging.getLogger("areal_sdk.services.agent_worker")

# Built-in plugins a worker never uses (it needs the adapters only): the engine's, the
# trainer's and the gateway's import torch, which took half a worker's start and memory.
_SERVER_PLUGINS = (
    "embedded_engine",
    "train",
    "sglang",
    "gateway",
    "builtin_metrics",
    "builtin_rewards",
)
# Agent return values that cross the pipe as these builtins (a numpy float as a float: the
# parent may not be able to import a subclass's module); any other is sent as its type name.
_PLAIN_RESULTS = (bool, int, float, str)


# -- the wire format -----------------------------------------------------------------------


def request_of(
    task: Any, ctx: EpisodeContext, agent_kwargs: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """What a worker needs to run ``task`` in the episode ``ctx`` opened in the parent."""
    ep = ctx.episode
    return {
        "task": task,
        "episode": {
            "id": ep.id,
            "task_id": ep.task_id,
            "group_id": ep.group_id,
            "metadata": ep.metadata,
            "started": ep.started,
        },
        "name": ctx.name,
        "base_url": ctx.base_url,
        "api_key": ctx.api_key,
        "agent_kwargs": agent_kwargs,
        "timeout_s": timeout_s,
    }


def context_of(request: dict[str, Any]) -> EpisodeContext:
    """The worker's copy of the parent's episode context."""
    from areal_sdk.tracing import EpisodeContext
    from areal_sdk.trajectory import Episode

    fields = request["episode"]
    episode = Episode(
        id=fields["id"],
        task_id=fields["task_id"],
        group_id=fields["group_id"],
        metadata=dict(fields["metadata"]),
        started=fields["started"],
    )
    return EpisodeContext(
        episode=episode,
        name=request["name"],
        base_url=request["base_url"],
        api_key=request["api_key"],
    )


def _json_safe(value: dict[str, Any]) -> dict[str, Any]:
    # The store keeps metadata as JSON anyway; anything else is kept as its repr.
    return json.loads(json.dumps(value, default=repr))


def outcome_of(result: Any, error: str | None, ctx: EpisodeContext) -> dict[str, Any]:
    """The agent's return value and what it changed on its episode, to send back."""
    ep = ctx.episode
    plain = next((t for t in _PLAIN_RESULTS if isinstance(result, t)), None)
    opaque = result is not None and plain is None
    return {
        "result": plain(result) if plain is not None else None,
        "result_type": type(result).__name__ if opaque else None,
        "error": error,
        "name": ctx.name,
        "status": str(ep.status),
        "episode_error": ep.error,
        "reward": ep.reward,
        "ended": ep.ended,
        "metadata": _json_safe(ep.metadata),
        "explicit_reward": ctx.explicit_reward,
        "turn_rewards": dict(ctx.turn_rewards),
        "reward_error": ctx.reward_error,
    }


def apply_outcome(ctx: EpisodeContext, outcome: dict[str, Any]) -> tuple[Any, str | None]:
    """Put a worker's outcome on the parent's ``ctx``; return ``(result, error)`` as the
    agent's own call would have."""
    from areal_sdk.trajectory import EpisodeStatus

    ep = ctx.episode
    ctx.name = outcome["name"]
    ep.status = EpisodeStatus(outcome["status"])
    ep.error = outcome["episode_error"]
    ep.reward = outcome["reward"]
    ep.ended = outcome["ended"]
    ep.metadata = outcome["metadata"]
    ctx.explicit_reward = outcome["explicit_reward"]
    ctx.turn_rewards = outcome["turn_rewards"]
    ctx.reward_error = outcome["reward_error"]
    result = outcome["result"]
    if outcome["result_type"] is not None:
        # Stands in for a value that did not cross the pipe; the controller names its type.
        result = type(outcome["result_type"], (), {})()
    return result, outcome["error"]


# -- the worker ----------------------------------------------------------------------------


class _Link:
    """The worker's end of the socket; sends from any thread, one at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message)
        with self._lock:
            self.conn.send_bytes(data)

    def beat_forever(self, interval_s: float) -> None:
        while True:
            try:
                self.send(("beat",))
            except OSError:
                _orphaned()
            time.sleep(interval_s)


def _orphaned() -> NoReturn:
    """The parent is gone: end this worker and whatever its agents started."""
    if os.getpgid(0) == os.getpid():  # a group of its own, as the pool starts it
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _adapter_host() -> PluginHost:
    """The process-wide plugin host, without the built-in plugins of the servers."""
    from areal_sdk.plugin_host import DISABLE_ENV, get_host

    user_choice = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = ",".join([user_choice or "", *_SERVER_PLUGINS]).strip(",")
    try:
        return get_host()
    finally:  # the agent's own child processes see the user's setting
        if user_choice is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = user_choice


async def _run_episode(link: _Link, agent: Any, call_id: int, request: dict[str, Any]) -> None:
    from areal_sdk.rollout import InProcessRunner

    ctx = context_of(request)
    runner = InProcessRunner(agent, request["agent_kwargs"])
    result, error = await runner.call(request["task"], ctx, timeout_s=request["timeout_s"])
    link.send(("done", call_id, outcome_of(result, error, ctx)))


async def _serve(link: _Link, agent: Any) -> None:
    loop = asyncio.get_running_loop()
    running: dict[int, asyncio.Task[None]] = {}

    def on_message(message: tuple[Any, ...]) -> None:
        if message[0] == "call":
            _, call_id, request = message
            task = loop.create_task(_run_episode(link, agent, call_id, request))
            running[call_id] = task
            task.add_done_callback(lambda _: running.pop(call_id, None))
        elif message[0] == "cancel":
            task = running.get(message[1])
            if task is not None:
                task.cancel()  # an async agent stops; a sync one's thread is abandoned

    def read() -> None:
        while True:
            try:
                message = link.conn.recv()
            except (EOFError, OSError):
                _orphaned()
            loop.call_soon_threadsafe(on_message, message)

    threading.Thread(target=read, name="areal-worker-inbox", daemon=True).start()
    await asyncio.Event().wait()  # until the parent kills this process or goes away


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_sdk.services.agent_worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--entry", required=True)
    parser.add_argument("--search-path", action="append", default=[])
    parser.add_argument("--gateway-url", required=True)
    parser.add_argument("--framework-telemetry", action="store_true")
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    args = parser.parse_args(argv)

    configure_service_logging()
    link = _Link(Connection(args.fd))
    threading.Thread(
        target=link.beat_forever, args=(args.heartbeat_s,), name="areal-heartbeat", daemon=True
    ).start()

    from areal_sdk.hookspecs import GatewayRoute
    from areal_sdk.tasks import load_agent

    try:
        # Routing first: an agent module may build its clients at import.
        _adapter_host().install_routing(
            GatewayRoute(args.gateway_url, framework_telemetry=args.framework_telemetry)
        )
        agent = load_agent(args.entry, search_path=[Path(p) for p in args.search_path])
    except Exception as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        log.error("rollout worker %d cannot load the agent: %s", args.index, message)
        link.send(("error", message))
        return 1
    log.info("rollout worker %d ready (pid %d), agent %s", args.index, os.getpid(), args.entry)
    link.send(("ready", os.getpid()))
    asyncio.run(_serve(link, agent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
