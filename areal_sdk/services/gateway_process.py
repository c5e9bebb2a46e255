"""The gateway as a supervised process of its own (``run.placement: processes``).

The parent binds the gateway's listening socket once and hands it to each gateway process it
starts (``pass_fds``), so a restarted gateway serves the same address: agents keep their
base URL, and calls made while it restarts wait in the socket's backlog instead of being
refused. ``watch`` polls ``/health`` about once a second; a gateway that exits, or answers
nothing for ``heartbeat_timeout_s``, is killed and started again with the current engine
servers, until the restart policy gives up (``ServiceFailed``). Its open sessions are lost
with it: their agents' next calls get 401, and ``HttpSessions.end`` fails those episodes
alone. Logs go to ``<run_dir>/services/gateway.log``.

>>> gateway = GatewayProcess(cfg, run_dir=run, store_path=run / "trajectories.db",
...     engine_urls=urls, version=0, admin_token=token, sock=bind_tcp("127.0.0.1", 0),
...     policy=RestartPolicy(), heartbeat_timeout_s=10).start()      # doctest: +SKIP
>>> watcher = asyncio.create_task(gateway.watch())   # raises ServiceFailed if it gives up
>>> await gateway.set_engines([*urls, new_url], version=3)
>>> gateway.stop()
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from areal_sdk.config import Config
from areal_sdk.launcher import ADMIN_TOKEN_ENV, LaunchError
from areal_sdk.services.health import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    Phase,
    RestartPolicy,
    ServiceKind,
    ServiceState,
)
from areal_sdk.services.lifeline import Lifeline

log = logging.getLogger(__name__)

# How often ``watch`` asks /health, and how often it looks whether the process exited.
POLL_S = 1.0
EXIT_CHECK_S = 0.25
DEFAULT_START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0

ServiceEvent = Callable[[ServiceState, str], None]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class GatewayProcess:
    """One gateway process over ``engine_urls``, restarted on ``sock`` when it dies.

    ``sock`` (from ``areal_sdk.server_thread.bind_tcp``) stays the caller's: it outlives
    every gateway process and is closed by whoever bound it. ``on_event(state, message)``
    hears of deaths and restarts (for the progress line and the log).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        run_dir: str | Path,
        store_path: str | Path,
        engine_urls: list[str],
        version: int,
        admin_token: str,
        sock: socket.socket,
        policy: RestartPolicy | None = None,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        on_event: ServiceEvent | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        name: str = "gateway",
    ) -> None:
        if not engine_urls:
            raise ValueError("the gateway needs at least one engine server URL")
        self.cfg = cfg
        self.store_path = Path(store_path)
        self.engine_urls = list(engine_urls)
        self.version = int(version)
        self.admin_token = admin_token
        self.sock = sock
        self.policy = policy or RestartPolicy()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_event = on_event
        self.start_timeout_s = start_timeout_s
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.state = ServiceState(kind=ServiceKind.GATEWAY, name=name, url=self.url)
        services = Path(run_dir) / "services"
        services.mkdir(parents=True, exist_ok=True)
        self.log_path = services / f"{name}.log"
        self.config_path = services / f"{name}.yaml"
        self.config_path.write_text(cfg.to_yaml())
        self.config_path.chmod(0o600)  # agent.kwargs may hold a judge's API key
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None
        self._stopping = False

    # -- the process -------------------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen[bytes]:
        lifeline = Lifeline()
        command = [
            sys.executable,
            "-m",
            "areal_sdk.services.gateway_main",
            "--config",
            str(self.config_path),
            "--fd",
            str(self.sock.fileno()),
            "--store",
            str(self.store_path),
            "--engines",
            *self.engine_urls,
            "--version",
            str(self.version),
            "--lifeline",
            str(lifeline.child_fd),
        ]
        with self.log_path.open("ab") as log_file:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log_file.write(f"=== {stamp} starting the gateway on {self.url}\n".encode())
            log_file.flush()
            try:
                process = subprocess.Popen(
                    command,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(self.sock.fileno(), lifeline.child_fd),
                    env={**os.environ, ADMIN_TOKEN_ENV: self.admin_token},
                    start_new_session=True,  # its own group: a Ctrl-C reaches the parent only
                )
            except BaseException:
                lifeline.close()
                raise
        lifeline.spawned()
        self._process, self._lifeline = process, lifeline
        self.state.pid = process.pid
        self.state.enter(Phase.STARTING)
        return process

    def _reap(self) -> None:
        """Kill the current process (if any) at once and wait for it, briefly."""
        process, self._process = self._process, None
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT_S)

    def _start_failed(self, process: subprocess.Popen[bytes], why: str) -> LaunchError:
        """Kill what is left of a gateway that did not start; the error quotes its log."""
        if process.poll() is not None:
            why = f"exited with code {process.returncode} while starting"
        self._reap()
        self.state.enter(Phase.FAILED, why)
        return LaunchError(f"the gateway {why}; log {self.log_path}:\n{_tail(self.log_path)}")

    def start(self) -> GatewayProcess:
        """Start the gateway and return once it answers ``/health``; raises ``LaunchError``
        with its log's tail if it exits first or does not answer within the bound."""
        atexit.register(self.stop)
        process = self._spawn()
        deadline = time.monotonic() + self.start_timeout_s
        pause = 0.1
        with httpx.Client(timeout=5) as http:
            while True:
                if process.poll() is not None:
                    raise self._start_failed(process, "exited")
                with contextlib.suppress(httpx.HTTPError):
                    http.get(self.url + "/health")
                    break
                if time.monotonic() > deadline:
                    raise self._start_failed(
                        process, f"did not answer within {self.start_timeout_s:g} s"
                    )
                time.sleep(pause)
                pause = min(pause * 1.5, 1.0)
        self.state.enter(Phase.UP)
        return self

    async def _probe(self, http: httpx.AsyncClient, timeout_s: float) -> bool:
        """Whether the gateway answers ``/health`` within ``timeout_s``: any answer counts,
        a 503 for an engine that is down too (the engine's supervisor handles that). Gives
        up at once if the process exits meanwhile."""
        process = self._process
        probe = asyncio.ensure_future(http.get(self.url + "/health", timeout=timeout_s))
        try:
            while not probe.done():
                await asyncio.wait({probe}, timeout=EXIT_CHECK_S)
                if process is None or process.poll() is not None:
                    return False
            return probe.exception() is None
        finally:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)

    async def _wait_ready(self, http: httpx.AsyncClient) -> str | None:
        """After a restart: None once the new gateway answers, else why it did not."""
        process = self._process
        assert process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if await self._probe(http, 5.0):
                return None
            if process.poll() is not None:
                return f"exited with code {process.returncode} while restarting"
            await asyncio.sleep(0.5)
        return f"did not answer within {self.start_timeout_s:g} s of restarting"

    async def watch(self) -> None:
        """Watch the gateway until ``stop``: a gateway that exits, or answers nothing for
        ``heartbeat_timeout_s``, is killed and restarted on the same socket. Raises
        ``ServiceFailed`` once the restart policy gives up."""
        if self._process is None and not self._stopping:
            raise RuntimeError("start() the gateway before watching it")
        async with httpx.AsyncClient() as http:
            last_answer = time.monotonic()
            while not self._stopping:
                tick = time.monotonic()
                process = self._process
                why = None
                if process is None or process.poll() is not None:
                    code = None if process is None else process.returncode
                    why = f"exited with code {code}"
                else:
                    left = self.heartbeat_timeout_s - (tick - last_answer)
                    if await self._probe(http, max(0.5, min(left, POLL_S * 5))):
                        last_answer = time.monotonic()
                    elif process.poll() is not None:
                        why = f"exited with code {process.returncode}"
                    elif time.monotonic() - last_answer >= self.heartbeat_timeout_s:
                        why = f"did not answer /health for {self.heartbeat_timeout_s:g} s"
                if self._stopping:
                    return
                if why is not None:
                    await self._restart(http, why)
                    last_answer = time.monotonic()
                    continue
                await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - tick)))

    async def _restart(self, http: httpx.AsyncClient, why: str) -> None:
        """Kill and start again, counting each failure (a restart that fails included)
        against the policy, which raises ``ServiceFailed`` when it gives up."""
        while not self._stopping:
            self._reap()
            log.warning("the gateway %s; restarting it", why)
            self._event(f"{self.state.name} {why}")
            self.policy.record_failure(self.state, why)  # raises ServiceFailed past the budget
            self._spawn()
            failed = await self._wait_ready(http)
            if self._stopping:  # stop() killed the new gateway: no failure of its own
                return
            if failed is None:
                self.state.enter(Phase.UP)
                self._event(f"{self.state.name} restarted (pid {self.state.pid})")
                return
            why = f"{failed}: {_tail(self.log_path, 3)}"

    def _event(self, message: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(self.state, message)
            except Exception:  # a display callback never stops the supervision
                log.exception("on_event failed")

    # -- engines -----------------------------------------------------------------------------

    async def set_engines(self, urls: list[str], version: int) -> None:
        """Send generations to ``urls`` (serving weight ``version``) from now on, in this
        gateway and in any it is restarted as. Raises ``LaunchError`` if the live gateway
        refuses (its answer says why)."""
        if not urls:
            raise ValueError("the gateway needs at least one engine server URL")
        self.engine_urls, self.version = list(urls), int(version)
        if self.state.phase != Phase.UP:
            return  # a gateway restarting now starts with them
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.put(
                self.url + "/rl/admin/engines",
                json={"servers": self.engine_urls, "version": self.version},
                headers={"Authorization": f"Bearer {self.admin_token}"},
            )
        if response.status_code != 200:
            raise LaunchError(
                f"the gateway refused the engine servers ({response.status_code}): "
                f"{response.text[:300]}"
            )

    # -- state and shutdown ------------------------------------------------------------------

    def states(self) -> list[ServiceState]:
        return [self.state]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the gateway process (``kill -9`` by default), as a crash would (tests)."""
        if self._process is not None:
            os.kill(self._process.pid, sig)

    def stop(self) -> None:
        """Stop watching; SIGTERM the gateway (it finishes calls in flight), SIGKILL it if
        it has not exited within ``STOP_TIMEOUT_S``. Idempotent."""
        self._stopping = True
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT_S)
        self._reap()
        if self.state.phase != Phase.FAILED:
            self.state.enter(Phase.STOPPED)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
