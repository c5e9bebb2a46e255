"""Rollout workers: the user's agents in processes that a supervisor can kill and replace.

``AgentWorkerPool`` is an ``AgentRunner``: the rollout controller opens each episode's
gateway session here, the pool runs the agent in the least loaded live worker
(``agent_worker.py``) and puts what the agent did back on the episode, so the controller
finalizes and stores it as it would an agent of its own process.

``watch()`` is the supervision loop. A worker that exited, or that has not beaten its
heartbeat for ``heartbeat_timeout_s``, is killed with its process group, its in-flight
episodes fail alone (``"rollout worker 1 died (exit -9); episode failed"``; the
controller's ``rollout.retries`` re-run them), and a replacement starts, until the
``RestartPolicy`` budget is spent: then ``ServiceFailed`` leaves ``watch()`` and stops the run.

>>> pool = AgentWorkerPool("agent:solve", workers=2, search_path=[config_dir],
...     gateway_url=url, framework_telemetry=False, run_dir=run_dir)  # doctest: +SKIP
>>> await pool.start()                                                # doctest: +SKIP
>>> controller = RolloutController(agent, sessions, runner=pool.runner(kwargs))  # +SKIP
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from areal_sdk.launcher import LaunchError
from areal_sdk.services.agent_worker import apply_outcome, request_of
from areal_sdk.services.health import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    Phase,
    RestartPolicy,
    ServiceKind,
    ServiceState,
)
from areal_sdk.tracing import EpisodeContext

log = logging.getLogger(__name__)

# Bounds on waits that should take milliseconds: a killed worker's exit, its threads' end.
_EXIT_WAIT_S = 5.0
_JOIN_S = 2.0


class _Worker:
    """One worker process as the pool sees it; replaced whole when it dies."""

    def __init__(self, index: int, state: ServiceState, loop: asyncio.AbstractEventLoop):
        self.index = index
        self.label = f"rollout worker {index}"
        self.state = state
        self.spawned = self.last_seen = time.monotonic()  # last_seen: of any message
        self.in_flight: dict[int, asyncio.Future[dict[str, Any] | str]] = {}
        self.dispatched = 0
        # None once it said ready; why not, if it never will.
        self.ready: asyncio.Future[str | None] = loop.create_future()
        self.load_error: str | None = None
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.conn: Connection | None = None
        self.threads: list[threading.Thread] = []

    @property
    def live(self) -> bool:
        return self.state.phase == Phase.UP and self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True)
class _BoundRunner:
    """A pool (this module's or Ray's) as one controller's ``AgentRunner``, with that
    controller's agent kwargs."""

    pool: Any
    agent_kwargs: dict[str, Any]

    async def call(
        self, task: Any, ctx: EpisodeContext, *, timeout_s: float
    ) -> tuple[Any, str | None]:
        return await self.pool.call(task, ctx, timeout_s=timeout_s, agent_kwargs=self.agent_kwargs)

    async def close(self) -> None:
        """The pool outlives its controllers: whoever started it closes it."""


class AgentWorkerPool:
    """``workers`` processes running the agent ``entry``, supervised (module docstring).

    ``run_dir/services/rollout-worker-N.log`` holds worker N's output, restarts included.
    Start, call, watch and close it from one event loop.
    """

    def __init__(
        self,
        entry: str,
        *,
        workers: int,
        search_path: list[Path],
        gateway_url: str,
        framework_telemetry: bool,
        run_dir: Path,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        policy: RestartPolicy | None = None,
        on_event: Callable[[str], None] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"rollout.workers must be at least 1, got {workers}")
        self.entry = entry
        self.search_path = [Path(p) for p in search_path]
        self.gateway_url = gateway_url
        self.framework_telemetry = framework_telemetry
        self.log_dir = Path(run_dir) / "services"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.policy = policy or RestartPolicy()
        self.on_event = on_event
        self.start_timeout_s = start_timeout_s
        # A worker beats several times per timeout; the watch looks as often (and at once
        # when a worker's connection drops).
        self._beat_s = min(1.0, heartbeat_timeout_s / 3)
        self._poll_s = min(1.0, heartbeat_timeout_s / 4)
        self._states = [
            ServiceState(kind=ServiceKind.ROLLOUT_WORKER, name=f"rollout-worker-{i}")
            for i in range(workers)
        ]
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # a worker's connection dropped
        self._up: asyncio.Event | None = None  # a worker came up
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each has imported the agent; raise
        ``LaunchError`` with the reason when one cannot (the agent's import error)."""
        self._loop = asyncio.get_running_loop()
        self._wake, self._up = asyncio.Event(), asyncio.Event()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self._kill_all)
        try:
            self._workers = [self._spawn(i) for i in range(len(self._states))]
            pending = {w.ready for w in self._workers}
            deadline = time.monotonic() + self.start_timeout_s
            while pending:
                done, pending = await asyncio.wait(
                    pending,
                    timeout=max(0.0, deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done or any(f.result() is not None for f in done):
                    break  # out of time, or one cannot start: say why below
            # Why the first that cannot start cannot, else which did not in time.
            failed = [w for w in self._workers if w.ready.done() and w.ready.result()]
            late = [w for w in self._workers if not w.ready.done()]
            if failed:
                w = failed[0]
                raise LaunchError(f"{w.label} {w.ready.result()} (log: {self._log_path(w.index)})")
            if late:
                w = late[0]
                raise LaunchError(
                    f"{w.label} did not start within {self.start_timeout_s:g} s "
                    f"(log: {self._log_path(w.index)})"
                )
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Kill every worker (and whatever its agents started) and wait for them, bounded."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        workers, self._workers = self._workers, []

        def stop_all() -> None:
            for w in workers:
                self._stop(w)

        await asyncio.to_thread(stop_all)
        for w in workers:
            self._fail_in_flight(w, "rollout workers stopped; episode failed")
            w.state.enter(Phase.STOPPED)
        atexit.unregister(self._kill_all)

    def states(self) -> list[ServiceState]:
        return list(self._states)

    def kill(self, index: int) -> None:
        """``kill -9`` worker ``index``'s process group, as a crash would (for tests)."""
        proc = self._workers[index].proc
        assert proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def watch(self) -> None:
        """Replace dead and stalled workers until ``close()``; raises ``ServiceFailed`` when
        one fails more often than the restart policy allows."""
        assert self._wake is not None, "start() the pool first"
        while not self._closing:
            self._wake.clear()
            for w in list(self._workers):
                why = self._fault(w)
                if why is not None and not self._closing:
                    await self._replace(w, why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)

    # -- episodes ----------------------------------------------------------------------------

    def runner(self, agent_kwargs: dict[str, Any] | None = None) -> _BoundRunner:
        """This pool as a controller's ``AgentRunner``, passing ``agent_kwargs`` to the agent."""
        return _BoundRunner(self, dict(agent_kwargs or {}))

    async def call(
        self,
        task: Any,
        ctx: EpisodeContext,
        *,
        timeout_s: float,
        agent_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Any, str | None]:
        """Run the agent on ``task`` in the least loaded live worker (``AgentRunner.call``)."""
        worker = await self._pick(timeout_s)
        if worker is None:
            return None, "no rollout worker is up; episode failed"
        call_id = next(self._ids)
        request = request_of(task, ctx, agent_kwargs or {}, timeout_s)
        try:
            data = pickle.dumps(("call", call_id, request))
        except Exception as exc:  # an unpicklable task fails its episode alone
            return None, f"the task cannot be sent to a rollout worker: {type(exc).__name__}: {exc}"
        assert self._loop is not None
        answer: asyncio.Future[dict[str, Any] | str] = self._loop.create_future()
        worker.in_flight[call_id] = answer
        worker.dispatched += 1
        worker.outbox.put(data)
        # The worker times the agent out itself; this bound only covers a worker that
        # beats but never answers.
        bound = timeout_s + max(self.heartbeat_timeout_s, 5.0)
        try:
            outcome = await asyncio.wait_for(answer, bound)
        except TimeoutError:
            return None, f"{worker.label} did not answer within {bound:g} s; episode failed"
        except asyncio.CancelledError:
            worker.outbox.put(pickle.dumps(("cancel", call_id)))
            raise
        finally:
            worker.in_flight.pop(call_id, None)
        if isinstance(outcome, str):  # the supervisor failed it: its worker died
            return None, outcome
        return apply_outcome(ctx, outcome)

    async def _pick(self, within_s: float) -> _Worker | None:
        assert self._up is not None, "start() the pool first"
        deadline = time.monotonic() + within_s
        while not self._closing:
            live = [w for w in self._workers if w.live]
            if live:
                return min(live, key=lambda w: (len(w.in_flight), w.dispatched))
            self._up.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), left)
        return None

    # -- supervision -------------------------------------------------------------------------

    def _fault(self, w: _Worker) -> str | None:
        assert w.proc is not None
        code = w.proc.poll()
        if code is not None:
            return f"died (exit {code})" + (f": {w.load_error}" if w.load_error else "")
        if w.state.phase == Phase.STARTING:  # importing the agent: the start bound applies
            if time.monotonic() - w.spawned > self.start_timeout_s:
                return f"did not start within {self.start_timeout_s:g} s"
            return None
        silent = time.monotonic() - w.last_seen
        if silent > self.heartbeat_timeout_s:
            return f"stalled (no heartbeat for {silent:.0f} s)"
        return None

    async def _replace(self, w: _Worker, why: str) -> None:
        w.state.enter(Phase.RESTARTING)  # no new episode goes to it
        self._event(f"{w.label} {why}; restarting it")
        await asyncio.to_thread(self._stop, w)
        self._fail_in_flight(w, f"{w.label} {why}; episode failed")
        self.policy.record_failure(w.state, f"{w.label} {why}")  # raises past the budget
        self._workers[w.index] = self._spawn(w.index)

    def _fail_in_flight(self, w: _Worker, error: str) -> None:
        for answer in w.in_flight.values():
            if not answer.done():
                answer.set_result(error)
        w.in_flight.clear()

    def _event(self, message: str) -> None:
        # Once: the run's display shows what it is given; without one, the log does.
        log.log(logging.INFO if self.on_event is not None else logging.WARNING, "%s", message)
        if self.on_event is not None:
            try:
                self.on_event(message)
            except Exception:  # a display's bug must not stop the supervision
                log.exception("the rollout workers' event callback failed")

    # -- one worker's process and threads ---------------------------------------------------

    def _log_path(self, index: int) -> Path:
        return self.log_dir / f"{self._states[index].name}.log"

    def _spawn(self, index: int) -> _Worker:
        assert self._loop is not None
        state = self._states[index]
        w = _Worker(index, state, self._loop)
        ours, theirs = socket.socketpair()
        cmd = [
            sys.executable,
            "-m",
            "areal_sdk.services.agent_worker",
            f"--fd={theirs.fileno()}",
            f"--index={index}",
            f"--entry={self.entry}",
            f"--gateway-url={self.gateway_url}",
            f"--heartbeat-s={self._beat_s:g}",
            *[f"--search-path={p}" for p in self.search_path],
            *(["--framework-telemetry"] if self.framework_telemetry else []),
        ]
        try:
            with open(self._log_path(index), "ab") as out:
                w.proc = subprocess.Popen(
                    cmd,
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,  # a group of its own: one kill ends its children
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        w.sock, w.conn = ours, Connection(os.dup(ours.fileno()))
        state.pid = w.proc.pid
        state.enter(Phase.STARTING)
        w.threads = [
            threading.Thread(target=self._read, args=(w,), name=f"{state.name}-in", daemon=True),
            threading.Thread(target=self._write, args=(w,), name=f"{state.name}-out", daemon=True),
        ]
        for t in w.threads:
            t.start()
        return w

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop has closed
            self._loop.call_soon_threadsafe(fn, *args)

    def _read(self, w: _Worker) -> None:
        """The worker's messages, on a thread: heartbeats counted here, the rest on the loop."""
        assert w.conn is not None and w.proc is not None
        while True:
            try:
                data = w.conn.recv_bytes()
            except (EOFError, OSError):
                break
            w.last_seen = time.monotonic()
            try:
                message = pickle.loads(data)
            except Exception as exc:  # never from this package's worker; say so, read on
                log.warning("%s sent a message that cannot be read: %s", w.label, exc)
                continue
            if message[0] != "beat":
                self._post(self._on_message, w, message)
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(_EXIT_WAIT_S)  # for its exit code, which the loop reports
        self._post(self._on_lost, w)

    def _write(self, w: _Worker) -> None:
        assert w.conn is not None
        while (data := w.outbox.get()) is not None:
            try:
                w.conn.send_bytes(data)
            except OSError:
                return  # it died; the reader and the watch see to it

    def _on_message(self, w: _Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "done":
            answer = w.in_flight.pop(message[1], None)
            if answer is not None and not answer.done():
                answer.set_result(message[2])
        elif kind == "ready":
            w.state.enter(Phase.UP)
            if w.state.restarts:
                self._event(f"{w.label} restarted (pid {message[1]})")
            if not w.ready.done():
                w.ready.set_result(None)
            assert self._up is not None
            self._up.set()
        elif kind == "error":
            w.load_error = message[1]
            if not w.ready.done():
                w.ready.set_result(f"cannot load the agent: {message[1]}")

    def _on_lost(self, w: _Worker) -> None:
        if not w.ready.done():
            code = w.proc.poll() if w.proc is not None else None
            w.ready.set_result(f"exited (code {code}) before it was ready")
        if self._wake is not None:
            self._wake.set()

    def _stop(self, w: _Worker) -> None:
        """Kill ``w``'s process group and release its socket and threads (blocking, bounded)."""
        if w.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            try:
                w.proc.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not exit after SIGKILL", w.label, w.proc.pid)
        w.outbox.put(None)
        if w.sock is not None:
            with contextlib.suppress(OSError):
                w.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader blocked in recv
        for t in w.threads:
            if t is not threading.current_thread():
                t.join(_JOIN_S)
        for closable in (w.conn, w.sock):
            if closable is not None:
                with contextlib.suppress(OSError):
                    closable.close()

    def _kill_all(self) -> None:
        """At interpreter exit: no worker outlives the run, even one never closed."""
        for w in self._workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, signal.SIGKILL)
