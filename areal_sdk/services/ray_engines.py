"""Engine servers on a Ray cluster: each the same ``areal-sdk engine`` server as under
``processes``, started by a small actor on the node Ray chose, as that actor's child.

The actor binds the server to its node's IP on a port free there and reports the URL; the
fleet (``EngineFleet``, unchanged) then probes, routes, pushes weights and restarts exactly
as it does for local processes. ``RemoteServer`` gives the fleet the part of
``subprocess.Popen`` it uses (``poll``, ``wait``, ``send_signal``, ``pid``). An actor that
dies, or whose node leaves the cluster, reads as a server that exited: the fleet takes it
out of rotation, counts it against the restart policy and starts a fresh actor, which Ray
places on a node that has the resources (its placement-group bundle, moved to a live node).
The server dies with its actor: the actor holds its lifeline (``services/lifeline.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from areal_sdk.launcher import LaunchError
from areal_sdk.services.engine_fleet import EngineFleet, _Server, _StartFailed
from areal_sdk.services.health import Phase
from areal_sdk.services.lifeline import Lifeline
from areal_sdk.services.ray_placement import NodeInfo, RayPlacement, first_line, free_port

log = logging.getLogger(__name__)

# Filled in by the actor on its node: its Python, its IP, a port free there.
PYTHON, HOST, PORT = "{python}", "{host}", "{port}"


@ray.remote(max_concurrency=4)  # start, wait and signal run side by side
class ServerActor:
    """Runs one engine server process on this actor's node."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.lifeline: Lifeline | None = None
        self.launched = threading.Event()

    def start(self, command: list[str], log_path: str, lifeline: bool = True) -> dict[str, Any]:
        """Start the server; with ``lifeline`` (our own engine, not SGLang's launcher) it
        exits when this actor's process does."""
        node = NodeInfo.here()
        port = free_port(node.ip)
        fill = {PYTHON: sys.executable, HOST: node.ip, PORT: str(port)}
        argv = [fill.get(arg, arg) for arg in command]
        line = Lifeline() if lifeline else None
        if line is not None:
            argv += ["--lifeline", str(line.child_fd)]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(line.child_fd,) if line is not None else (),
                start_new_session=True,
            )
        if line is not None:
            line.spawned()
        self.lifeline = line  # held for the actor's life
        self.launched.set()
        host = f"[{node.ip}]" if ":" in node.ip else node.ip
        return {
            "url": f"http://{host}:{port}",
            "port": port,
            "pid": self.process.pid,
            "node_id": node.node_id,
            "ip": node.ip,
        }

    def wait(self) -> int:
        """The server's exit code, once it exits."""
        self.launched.wait()
        assert self.process is not None
        return self.process.wait()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)


class RemoteServer:
    """A server process on a Ray node, as the engine fleet sees a ``subprocess.Popen``."""

    def __init__(self, actor: Any, started: ray.ObjectRef) -> None:
        self.actor = actor
        self.started = started  # ServerActor.start's answer
        self.exited = actor.wait.remote()
        self.pid: int | None = None
        self.returncode: int | None = None
        self.placed = False

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _ = ray.wait([self.exited], timeout=0)
        if not ready:
            return None
        try:
            self.returncode = int(ray.get(self.exited))
        except RayActorError as exc:  # killed, or its node left the cluster
            self.returncode = -int(signal.SIGKILL)
            log.warning("the actor of engine server pid %s died: %s", self.pid, first_line(exc))
        except RayError as exc:
            self.returncode = -1
            log.warning("the actor of engine server pid %s failed: %s", self.pid, first_line(exc))
        ray.kill(self.actor, no_restart=True)  # its resources go back to the cluster
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = ray.wait([self.exited], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("engine server", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            ray.kill(self.actor, no_restart=True)  # the server follows within a second
        else:
            self.actor.signal.remote(int(sig))


class RayEngineFleet(EngineFleet):
    """``EngineFleet`` whose servers are launched by actors that ``placement`` places.

    ``nodes`` maps each server's name to the node it runs on now."""

    def __init__(self, cfg: Any, *, placement: RayPlacement, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        self.placement = placement
        self.nodes: dict[str, NodeInfo] = {}

    def _launch(self, member: _Server, *, version: int) -> _Server:
        if self._stopped:
            raise RuntimeError("the engine fleet is stopped")
        name = member.state.name
        member.log_path = self.log_dir / f"{name}.log"
        index = int(name.rsplit("-", 1)[1])
        actor = ServerActor.options(**self.placement.options("engine", index)).remote()
        started = actor.start.remote(
            _portable(self.command(member, version=version)),
            str(member.log_path),
            self.cfg.inference.backend != "sglang",
        )
        member.process = RemoteServer(actor, started)  # type: ignore[assignment]
        member.state.pid = None
        member.state.url = None  # known once the actor has a node
        member.control = None
        member.state.enter(Phase.STARTING)
        return member

    def _placed(self, member: _Server, info: dict[str, Any]) -> None:
        handle = member.process
        assert isinstance(handle, RemoteServer)
        handle.placed, handle.pid = True, int(info["pid"])
        member.port, member.state.url, member.state.pid = int(info["port"]), info["url"], handle.pid
        member.control = None
        node = NodeInfo(info["node_id"], info["ip"])
        self.nodes[member.state.name] = node
        self.on_event(member.state, f"engine server {member.state.name} starts on {node}")

    def _not_placed(self, member: _Server, why: str) -> str:
        return (
            f"engine server {member.state.name} {why} (it asks Ray for "
            f"{self.placement.resources('engine')})"
        )

    async def _wait_up(self, member: _Server) -> None:
        handle = member.process
        if isinstance(handle, RemoteServer) and not handle.placed:
            deadline = self.start_timeout_s
            try:
                info = await asyncio.wait_for(
                    asyncio.wrap_future(handle.started.future()), deadline
                )
            except TimeoutError:
                raise _StartFailed(
                    self._not_placed(member, f"found no node within {deadline:g} s")
                ) from None
            except RayError as exc:
                raise _StartFailed(
                    self._not_placed(member, f"could not start: {first_line(exc)}")
                ) from None
            self._placed(member, info)
        await super()._wait_up(member)

    def _wait_up_blocking(self, member: _Server, http: httpx.Client, deadline: float) -> None:
        handle = member.process
        if isinstance(handle, RemoteServer) and not handle.placed:
            try:
                info = ray.get(handle.started, timeout=max(0.1, deadline - time.monotonic()))
            except GetTimeoutError:
                raise LaunchError(
                    self._not_placed(member, f"found no node within {self.start_timeout_s:g} s")
                ) from None
            except RayError as exc:
                raise LaunchError(
                    self._not_placed(member, f"could not start: {first_line(exc)}")
                ) from None
            self._placed(member, info)
        super()._wait_up_blocking(member, http, deadline)


def _portable(command: list[str]) -> list[str]:
    """``command`` with what only the actor's node knows left as placeholders: the Python,
    the host and port to bind; a ``cuda:N`` device becomes ``cuda`` (the GPUs Ray gave the
    actor are the ones its process sees)."""
    out = [PYTHON if i == 0 and arg == sys.executable else arg for i, arg in enumerate(command)]
    for flag, value in (("--host", HOST), ("--port", PORT)):
        if flag in out:
            out[out.index(flag) + 1] = value
    if "--device" in out:
        at = out.index("--device") + 1
        if out[at].startswith("cuda"):
            out[at] = "cuda"
    return out
