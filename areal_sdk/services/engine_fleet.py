"""Engine servers as supervised processes: launch N, watch them, restart a dead one with the
latest weights, add and remove servers while a job runs.

Each server is ``python -m areal_sdk engine`` (the embedded engine on SGLang's native routes)
or, with ``inference.backend: sglang``, ``sglang.launch_server``; each runs in its own process
group, logs to ``<run_dir>/services/engine-<i>.log`` and dies with this process. One
``SGLangBackend`` over the servers (``fleet.backend``) routes requests with session affinity
and carries the trainer's weight pushes to every server in rotation.

``watch()`` probes each server about once a second. A server that exited, or has not
answered ``/health`` for ``heartbeat_timeout_s``, is counted against the restart policy (the
failure past the budget raises ``ServiceFailed``), taken out of rotation at once, restarted
on the same port, brought to the latest weights, and only then put back. Requests that were
running on it are re-sent to another server by the backend.

>>> fleet = EngineFleet(cfg, run_dir="runs/a", servers=2, latest_weights=latest).start()
>>> watcher = asyncio.create_task(fleet.watch())   # raises ServiceFailed when one keeps dying
>>> url = await fleet.add()                          # one more server, at the current version
>>> await fleet.remove(url)                          # drained, then stopped
>>> fleet.stop()
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from areal_sdk.backends.sglang.client import SGLangError
from areal_sdk.services.health import (
    Phase,
    RestartPolicy,
    ServiceKind,
    ServiceState,
)
from areal_sdk.services.lifeline import Lifeline
from areal_sdk.supervisor import LatestWeights

if TYPE_CHECKING:
    from areal_sdk.backends.sglang import SGLangBackend
    from areal_sdk.backends.sglang.client import ServerClient
    from areal_sdk.backends.sglang.pool import Server
    from areal_sdk.config import Config

log = logging.getLogger(__name__)

POLL_S = 1.0
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long
RESTART_WEIGHTS_DIR = "restart-weights"
CATCH_UP_TRIES = 3  # loads in a row that a newer push overtook, before the server counts as failed

# (state of the server, what happened): for the progress display and the run's log.
OnEvent = Callable[[ServiceState, str], None]
# (urls in rotation, weight version): the stack forwards it to the gateway's own backend.
OnChange = Callable[[list[str], int], None]


class _StartFailed(RuntimeError):
    """A server process that exited, or did not answer, while starting."""


@dataclass
class _Server:
    state: ServiceState
    port: int
    process: subprocess.Popen[bytes] | None = None  # None: attached, not launched here
    log_path: Path | None = None
    last_ok: float = 0.0  # monotonic time of the last answered /health
    served: int | None = None  # the weight version it said it serves, at the last probe
    pending: str | None = None  # "restart" or "catch up": out of rotation until done
    control: ServerClient | None = None
    lifeline: Lifeline | None = None  # the server exits when this closes (launched only)

    def cut_lifeline(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None

    @property
    def url(self) -> str:
        return self.state.url or ""


class EngineFleet:
    """N engine servers, each its own process, behind one ``SGLangBackend``."""

    def __init__(
        self,
        cfg: Config,
        *,
        run_dir: str | Path | None = None,
        servers: int | None = None,
        policy: RestartPolicy | None = None,
        heartbeat_timeout_s: float | None = None,
        on_event: OnEvent | None = None,
        on_change: OnChange | None = None,
        latest_weights: LatestWeights | None = None,
        start_timeout_s: float | None = None,
        drain_timeout_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir if run_dir is not None else cfg.run.dir)
        self.log_dir = self.run_dir / "services"
        self.count = servers if servers is not None else cfg.inference.servers
        if self.count < 1:
            raise ValueError(f"an engine fleet needs at least one server, got {self.count}")
        self.policy = policy or RestartPolicy(cfg.run.max_restarts, cfg.run.restart_window_s)
        self.heartbeat_timeout_s = heartbeat_timeout_s or cfg.run.heartbeat_timeout_s
        self.on_event = on_event or (lambda state, message: log.warning(message))
        self.on_change = on_change
        self.latest_weights = latest_weights
        self.start_timeout_s = start_timeout_s or cfg.inference.launch_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.members: list[_Server] = []
        self._backend: SGLangBackend | None = None
        self._next_index = 0
        self._recovering: dict[str, asyncio.Task[None]] = {}
        self._stopped = False

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def backend(self) -> SGLangBackend:
        if self._backend is None:
            raise RuntimeError("the engine fleet is not started")
        return self._backend

    def start(self) -> EngineFleet:
        """Launch the servers, wait until each answers ``/health`` (a server that exits
        meanwhile fails this, quoting its log), and build ``backend`` over them."""
        from areal_sdk.backends.sglang import SGLangBackend
        from areal_sdk.backends.sglang.backend import _load_tokenizer

        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            launched = [self._launch(self._new_member(), version=0) for _ in range(self.count)]
            deadline = time.monotonic() + self.start_timeout_s
            with httpx.Client(timeout=5) as http:
                for member in launched:
                    self._wait_up_blocking(member, http, deadline)
            inference = self.cfg.inference
            self._backend = SGLangBackend(
                [m.url for m in launched],
                tokenizer=_load_tokenizer(self.cfg),
                model_name=self.cfg.model.served_name,
                timeout_s=inference.request_timeout_s,
                retries=inference.retries,
            )
            # This fleet restarts dead servers: an update finding none waits for one.
            self._backend.rejoin_timeout_s = self.start_timeout_s
            self._backend.connect()
        except BaseException:
            self.stop()
            raise
        for member in launched:
            self._up(member, f"engine server {member.state.name} serves at {member.url}")
        return self

    def stop(self) -> None:
        """Stop every launched server (SIGTERM to its group, SIGKILL after a grace). Idempotent.
        Cancel ``watch()`` first: its restarts run on its event loop (a restart that is
        still under way launches nothing more). ``await fleet.backend.close()`` closes the
        backend's connections."""
        self._stopped = True
        members, self.members = self.members, []
        for member in members:
            _signal_group(member.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for member in members:
            _reap(member.process, max(0.1, deadline - time.monotonic()))
            member.cut_lifeline()
            member.state.enter(Phase.STOPPED)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    @property
    def urls(self) -> list[str]:
        """The servers in rotation."""
        return [m.url for m in self.members if m.state.phase == Phase.UP]

    def states(self) -> list[ServiceState]:
        return [m.state for m in self.members]

    def kill(self, index: int) -> None:
        """``kill -9`` server ``index``'s process group (for tests and drills)."""
        _signal_group(self.members[index].process, signal.SIGKILL)

    # -- supervision ------------------------------------------------------------------------

    async def watch(self, poll_s: float = POLL_S) -> None:
        """Probe every server each ``poll_s`` seconds and recover the dead or stalled ones,
        until cancelled. Raises ``ServiceFailed`` when a server fails past its policy."""
        try:
            while True:
                await self.check()
                await asyncio.sleep(poll_s)
        finally:
            # A recovery cut short here is resumed by the next watch (``member.pending``).
            for task in self._recovering.values():
                task.cancel()
            self._recovering.clear()

    async def check(self) -> None:
        """One round: probe the servers in rotation, start the recovery of each one that
        failed (or resume one a cancelled watch left halfway), and raise the error of a
        recovery that gave up."""
        for name, task in list(self._recovering.items()):
            if task.done():
                del self._recovering[name]
                task.result()  # ServiceFailed, or the error that stopped the restart
        for member in self.members:
            resumable = member.pending is not None and member.state.phase != Phase.FAILED
            if resumable and member.state.name not in self._recovering:
                self._start_recovery(member, restart=member.pending == "restart")
        # Servers take a pushed version before the backend does: one that reads below the
        # version the backend had before the probe missed a push.
        version = self.backend.version
        members = [m for m in self.members if m.state.phase == Phase.UP]
        # Each server is handled as soon as its own probe ends: a slow one delays no other.
        await asyncio.gather(*(self._check_one(m, version) for m in members))

    async def _check_one(self, member: _Server, version: int) -> None:
        reason = await self._probe(member)
        if member.pending is not None or member.state.phase != Phase.UP:
            return  # removed or being handled while we probed
        if reason is not None:
            # Counted here, not in the task: the failure past the budget raises at once.
            self.policy.record_failure(member.state, reason)
            self._out_of_rotation(member)
            self.on_event(
                member.state,
                f"engine server {member.state.name} ({member.url}) {reason}; "
                f"restarting it ({member.state.restarts} of {self.policy.max_restarts} "
                f"in {self.policy.window_s:g} s)",
            )
            self._start_recovery(member, restart=True)
        elif member.served is not None and member.served < version:
            self._out_of_rotation(member)
            member.state.enter(Phase.STARTING)
            self.on_event(
                member.state,
                f"engine server {member.state.name} serves weight version "
                f"{member.served}, not {version}; loading the latest",
            )
            self._start_recovery(member, restart=False)

    def _start_recovery(self, member: _Server, *, restart: bool) -> None:
        member.pending = "restart" if restart else "catch up"
        self._recovering[member.state.name] = asyncio.create_task(
            self._recover(member, restart=restart)
        )

    async def _probe(self, member: _Server) -> str | None:
        """Why ``member`` must be restarted, or None while it is well (then
        ``member.served`` is the weight version it serves, where it says)."""
        member.served = None
        if member.process is not None and (code := member.process.poll()) is not None:
            return f"exited with code {code}"
        if await self._healthy(member, timeout_s=self._probe_timeout_s):
            member.last_ok = time.monotonic()
            member.served = await self._served_version(member)
            return None
        silent = time.monotonic() - member.last_ok
        if silent > self.heartbeat_timeout_s:
            return f"has not answered /health for {silent:.0f} s"
        return None

    async def _recover(self, member: _Server, *, restart: bool = True) -> None:
        """Restart ``member`` (already counted and out of rotation), bring it to the latest
        weights, and put it back in rotation. A start or a weight load that fails counts
        against the policy too, and is retried with a fresh process."""
        restarted = restart
        while True:
            try:
                if restart:
                    _signal_group(member.process, signal.SIGKILL)
                    await asyncio.to_thread(_reap, member.process, STOP_GRACE_S)
                    if member.process is not None:
                        self._launch(member, version=0)
                    await self._wait_up(member)
                await self._catch_up(member)
            except (_StartFailed, ConnectionError, SGLangError) as exc:
                self.policy.record_failure(member.state, str(exc))
                self.on_event(member.state, f"engine server {member.state.name}: {exc}")
                restart = restarted = True
                continue
            break
        await self._join(member)
        what = "serves again" if restarted else "caught up"
        self._up(
            member,
            f"engine server {member.state.name} {what} at weight version {self.backend.version}",
        )
        self._changed()

    # -- membership -------------------------------------------------------------------------

    async def add(self, url: str | None = None) -> str:
        """Launch one more server (or attach the running one at ``url``), bring it to the
        current weight version, then put it in rotation. Returns its URL."""
        member = self._new_member(url)
        try:
            if url is None:
                self._launch(member, version=0)
            await self._wait_up(member)
            await self._catch_up(member)
            await self._join(member)
        except BaseException as exc:
            self.backend.remove_server(member.url)
            self.members.remove(member)
            _signal_group(member.process, signal.SIGKILL)
            await asyncio.to_thread(_reap, member.process, STOP_GRACE_S)
            member.cut_lifeline()
            if isinstance(exc, _StartFailed):
                raise RuntimeError(f"engine server {member.state.name} {exc}") from None
            raise
        self._up(member, f"engine server {member.state.name} joined at {member.url}")
        self._changed()
        return member.url

    async def remove(self, url: str) -> None:
        """Take the server at ``url`` out of rotation, let its running requests end (at most
        ``drain_timeout_s``), then stop it if this fleet launched it."""
        member = next((m for m in self.members if m.url == url.rstrip("/")), None)
        if member is None:
            raise KeyError(f"no engine server {url} in this fleet")
        member.pending = None
        task = self._recovering.pop(member.state.name, None)
        if task is not None:
            task.cancel()
        member.state.enter(Phase.STOPPED)
        ours = self.backend.pool.find(member.url)
        self._out_of_rotation(member)
        self.on_event(member.state, f"engine server {member.state.name} leaves ({url})")
        await self._drain(member, ours)
        self.members.remove(member)
        _signal_group(member.process, signal.SIGTERM)
        await asyncio.to_thread(_reap, member.process, STOP_GRACE_S)
        member.cut_lifeline()

    async def _drain(self, member: _Server, ours: Server | None) -> None:
        """Wait until the server runs no request, this backend's or another client's (the
        gateway's), twice in a row: a request may still be on its way in. Bounded."""
        deadline = time.monotonic() + self.drain_timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            running = (ours.in_flight if ours is not None else 0) + await self._load(member)
            quiet = quiet + 1 if running == 0 else 0
            if quiet >= 2:
                return
            await asyncio.sleep(0.2)
        log.warning(
            "engine server %s still runs requests after %g s; stopping it",
            member.url,
            self.drain_timeout_s,
        )

    async def _load(self, member: _Server) -> int:
        """Requests the server runs or queues (0 if it cannot say)."""
        try:
            async with asyncio.timeout(5):
                load = (await self._control(member).get("/get_load")).json()
        except Exception:  # gone already, or an SGLang without the route
            return 0
        if isinstance(load, list):  # SGLang answers one entry per data-parallel rank
            return sum(int(x.get("num_reqs", 0)) for x in load)
        return int(load.get("num_reqs", 0))

    # -- one server -------------------------------------------------------------------------

    def _new_member(self, url: str | None = None) -> _Server:
        from areal_sdk.backends.sglang.launcher import _free_port

        name = f"engine-{self._next_index}"
        self._next_index += 1
        if url is None:
            port = _free_port(self.cfg.inference.host)
            url = f"http://{self.cfg.inference.host}:{port}"
        else:
            port = httpx.URL(url).port or 80
        state = ServiceState(kind=ServiceKind.ENGINE, name=name, url=url.rstrip("/"))
        member = _Server(state=state, port=port)
        self.members.append(member)
        return member

    def command(self, member: _Server, *, version: int) -> list[str]:
        """The command line that serves ``member`` on its port."""
        cfg, inference = self.cfg, self.cfg.inference
        index = int(member.state.name.rsplit("-", 1)[1])
        if inference.backend == "sglang":
            from areal_sdk.backends.sglang.launcher import SGLangLauncher

            launcher = SGLangLauncher.from_config(cfg)
            launcher.count = max(self.count, index + 1)
            return launcher.command(index, member.port)
        model = cfg.model.path or cfg.model.name
        if model is None:
            raise ValueError("an engine server needs model.path or model.name")
        cmd = [
            sys.executable, "-m", "areal_sdk", "engine",
            "--model", model,
            "--host", inference.host,
            "--port", str(member.port),
            "--device", _device(inference.device, index),
            "--dtype", cfg.model.dtype,
            "--max-batch-size", str(inference.max_batch_size),
            "--served-model-name", cfg.model.served_name,
            "--weight-version", str(version),
        ]  # fmt: skip
        if inference.max_model_len is not None:
            cmd += ["--max-model-len", str(inference.max_model_len)]
        if inference.prefill_chunk is not None:
            cmd += ["--prefill-chunk", str(inference.prefill_chunk)]
        if inference.idle_prefill_chunk is not None:
            cmd += ["--idle-prefill-chunk", str(inference.idle_prefill_chunk)]
        if cfg.model.tokenizer is not None:
            cmd += ["--tokenizer", cfg.model.tokenizer]
        if inference.cuda_graphs is not None:
            cmd.append("--cuda-graphs" if inference.cuda_graphs else "--no-cuda-graphs")
        if inference.prompt_hold_steps is not None:
            cmd += ["--prompt-hold-steps", str(inference.prompt_hold_steps)]
        if inference.overlap_decode is not None:
            cmd.append("--overlap-decode" if inference.overlap_decode else "--no-overlap-decode")
        if not inference.recompute_kv_on_update:
            cmd.append("--no-recompute-kv-on-update")
        if not inference.reuse_prefixes:
            cmd.append("--no-reuse-prefixes")
        return cmd

    def _launch(self, member: _Server, *, version: int) -> _Server:
        if self._stopped:
            raise RuntimeError("the engine fleet is stopped")
        member.log_path = self.log_dir / f"{member.state.name}.log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        member.cut_lifeline()  # the previous process's, after a restart
        command = self.command(member, version=version)
        # Our own servers die with this process, however it dies (services/lifeline.py);
        # SGLang's launcher takes no such argument.
        lifeline = Lifeline() if self.cfg.inference.backend != "sglang" else None
        if lifeline is not None:
            command += ["--lifeline", str(lifeline.child_fd)]
        with member.log_path.open("ab") as log_file:
            try:
                member.process = subprocess.Popen(
                    command,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(lifeline.child_fd,) if lifeline is not None else (),
                    start_new_session=True,  # its own process group: stop() reaches its children
                )
            except BaseException:
                if lifeline is not None:
                    lifeline.close()
                raise
        if lifeline is not None:
            lifeline.spawned()
        member.lifeline = lifeline
        member.state.pid = member.process.pid
        member.state.enter(Phase.STARTING)
        return member

    def _exited(self, member: _Server) -> _StartFailed | None:
        if member.process is None or (code := member.process.poll()) is None:
            return None
        from areal_sdk.backends.sglang.launcher import _tail

        return _StartFailed(
            f"exited with code {code} while starting; log {member.log_path}:\n"
            f"{_tail(member.log_path) if member.log_path else ''}"
        )

    def _wait_up_blocking(self, member: _Server, http: httpx.Client, deadline: float) -> None:
        from areal_sdk.backends.sglang.launcher import LaunchError

        pause = 0.1
        while True:
            if (failed := self._exited(member)) is not None:
                raise LaunchError(f"engine server {member.state.name} {failed}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(member.url + "/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise LaunchError(self._too_slow(member))
            time.sleep(pause)
            pause = min(pause * 1.5, 1.0)

    async def _wait_up(self, member: _Server) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pause = 0.1
        while True:
            if (failed := self._exited(member)) is not None:
                raise failed
            if await self._healthy(member, timeout_s=5):
                return
            if time.monotonic() > deadline:
                raise _StartFailed(self._too_slow(member))
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 1.0)

    def _too_slow(self, member: _Server) -> str:
        from areal_sdk.backends.sglang.launcher import _tail

        tail = _tail(member.log_path) if member.log_path else "(attached: no log here)"
        return (
            f"engine server {member.state.name} ({member.url}) did not answer /health within "
            f"{self.start_timeout_s:g} s (inference.launch_timeout_s); log "
            f"{member.log_path}:\n{tail}"
        )

    async def _catch_up(self, member: _Server) -> None:
        """Load the latest weights into ``member`` alone, under their version; again if a
        push landed meanwhile."""
        client = self._control(member)
        for _ in range(CATCH_UP_TRIES):
            target = self.backend.version
            weights = await self.latest_weights() if self.latest_weights else None
            if weights is not None:
                source, version = weights
                path = await asyncio.to_thread(self._as_directory, source)
                body = {
                    "model_path": str(path),
                    "weight_version": str(version),
                    "abort_all_requests": False,
                    "flush_cache": True,
                }
                await client.post_json("/update_weights_from_disk", body, idempotent=False)
            else:  # no push yet: the model's own weights are the current ones
                version = target
            await client.post_json(
                "/update_weight_version",
                {"new_version": str(version), "abort_all_requests": False},
            )
            if version >= self.backend.version:
                return
            # A push landed while this server loaded (it was not in rotation): load again.
        raise _StartFailed(
            f"could not catch up: the latest weights are version {version}, the other "
            f"servers serve {self.backend.version}"
        )

    async def _join(self, member: _Server) -> None:
        """Put ``member`` in rotation, paused first if the fleet is (a weight push is under
        way: the other servers hold their requests until ``resume()``, which reaches it too)."""
        if self.backend.paused:
            await self._control(member).post_json("/pause_generation", {"mode": "abort"})
        self.backend.add_server(member.url)

    def _as_directory(self, source: object) -> Path:
        """A directory the server can load: ``source`` itself, or named tensors written as
        safetensors to ``<run_dir>/services/restart-weights``."""
        if not isinstance(source, Mapping):
            return Path(str(source)).resolve()
        from areal_sdk.backends.weight_sync.disk import write_hf_weights

        out = self.log_dir / RESTART_WEIGHTS_DIR
        write_hf_weights([list(source.items())], out, model_dir=self.cfg.model.path)
        return out.resolve()

    async def _served_version(self, member: _Server) -> int | None:
        from areal_sdk.backends.sglang.protocol import parse_version

        route = "/get_weight_version"
        try:
            async with asyncio.timeout(self._probe_timeout_s):  # one try, bounded
                data = (await self._control(member).get(route)).json()
        except Exception:  # an SGLang without the route: the version is not watched
            return None
        return parse_version(data.get("weight_version"))

    async def _healthy(self, member: _Server, *, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s + 1):  # a bound whatever the client does
                return await self._control(member).healthy(timeout_s=timeout_s)
        except TimeoutError:
            return False

    @property
    def _probe_timeout_s(self) -> float:
        return max(0.5, self.heartbeat_timeout_s / 2)

    def _control(self, member: _Server) -> ServerClient:
        from areal_sdk.backends.sglang.client import ServerClient

        if member.control is None:
            member.control = ServerClient(
                member.url, timeout_s=self.cfg.inference.request_timeout_s, retries=1
            )
        return member.control

    def _up(self, member: _Server, message: str) -> None:
        member.pending = None
        member.last_ok = time.monotonic()
        member.state.enter(Phase.UP)
        self.on_event(member.state, message)

    def _out_of_rotation(self, member: _Server) -> None:
        if self._backend is not None:
            self._backend.remove_server(member.url)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None and self._backend is not None:
            self.on_change(self.urls, self._backend.version)


def _device(device: str, index: int) -> str:
    """Server ``index``'s device: ``cuda`` spreads the servers over the visible GPUs."""
    if device != "cuda":
        return device
    import torch

    count = torch.cuda.device_count()
    return f"cuda:{index % count}" if count > 1 else device


def _signal_group(process: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    if process is not None and process.poll() is None:
        if not isinstance(process, subprocess.Popen):  # on another machine (ray_engines.py)
            process.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)


def _reap(process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Wait for ``process`` (bounded); SIGKILL its group if it outlives ``timeout_s``."""
    if process is None:
        return
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait(10)
