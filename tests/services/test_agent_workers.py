"""Rollout workers for real: worker processes import an agent module written here, call the
real gateway (tiny embedded engine) through the official ``openai`` SDK, and are killed
with ``kill -9`` while they run episodes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from areal_sdk.launcher import InProcessSessions, LaunchError
from areal_sdk.rollout import RolloutController
from areal_sdk.services.agent_workers import AgentWorkerPool
from areal_sdk.services.health import Phase, RestartPolicy, ServiceFailed

pytestmark = pytest.mark.slow  # each test starts interpreters that import the SDK clients

AGENT = """
import asyncio
import os
import threading
import time
from pathlib import Path

import areal_sdk as areal
from openai import AsyncOpenAI, OpenAI


def ask(n):
    return [{"role": "user", "content": f"What is {n} + 1?"}]


@areal.trace
async def solve(task):
    reply = await AsyncOpenAI().chat.completions.create(
        model="gpt-4o", messages=ask(task["n"]), max_tokens=4
    )
    areal.current_episode().episode.metadata["pid"] = os.getpid()
    if "hold" in task:  # say where it runs, then wait for the test's word
        Path(task["hold"]).write_text(str(os.getpid()))
        while not Path(task["release"]).exists():
            await asyncio.sleep(0.05)
    return 1.0


@areal.trace
def solve_sync(task):
    if task["n"] % 10 == 0:
        threading.Event().wait()  # never returns
    OpenAI().chat.completions.create(model="gpt-4o", messages=ask(task["n"]), max_tokens=4)
    areal.reward(0.5)
"""


@pytest.fixture
def agent_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The agent uses the OpenAI SDK alone: the workers need not import the other frameworks.
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "langchain,openai_agents,camel,anthropic")
    path = tmp_path / "agent"
    path.mkdir()
    (path / "workeragent.py").write_text(AGENT)
    return path


def tasks(ns: range, **extra: object) -> list[dict]:
    return [{"id": f"t{n}", "n": n, **extra} for n in ns]


@contextlib.asynccontextmanager
async def running_pool(
    agent_dir: Path, gateway, entry: str = "workeragent:solve", **kwargs
) -> AsyncIterator[tuple[AgentWorkerPool, asyncio.Task[None]]]:
    kwargs.setdefault("workers", 2)
    kwargs.setdefault("heartbeat_timeout_s", 3.0)
    pool = AgentWorkerPool(
        entry,
        search_path=[agent_dir],
        gateway_url=gateway.base_url,
        framework_telemetry=False,
        run_dir=agent_dir.parent / "run",
        **kwargs,
    )
    await pool.start()
    watch = asyncio.create_task(pool.watch())
    try:
        yield pool, watch
    finally:
        await pool.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watch, 10)


def controller(pool: AgentWorkerPool, gateway, **kwargs) -> RolloutController:
    sessions = InProcessSessions(gateway.base_url, gateway.app.state.gateway, gateway.store)
    kwargs.setdefault("concurrency", 4)
    kwargs.setdefault("timeout_s", 60)
    return RolloutController(None, sessions, runner=pool.runner(), **kwargs)


async def until(condition: Callable[[], object], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        await asyncio.sleep(0.05)


def test_episodes_run_in_workers_and_are_stored_with_their_turns(agent_dir, gateway):
    async def scenario():
        async with running_pool(agent_dir, gateway) as (pool, _):
            pids = {s.pid for s in pool.states()}
            return pids, await controller(pool, gateway).run(tasks(range(6)))

    pids, summary = asyncio.run(scenario())
    assert len(summary.ok) == 6, [e.error for e in summary.failed]
    for episode in summary.episodes:
        stored = gateway.store.get(episode.id)
        assert stored.reward == 1.0 and stored.metadata["agent"] == "solve"
        [turn] = stored.turns
        assert turn.api == "openai.chat" and turn.completion_ids
        assert len(turn.logprobs) == len(turn.completion_ids) == len(turn.versions)
        assert f"What is {stored.task_id[1:]} + 1?" in str(turn.request)
    # Spread over both workers, each a process of its own.
    assert {e.metadata["pid"] for e in summary.episodes} == pids and os.getpid() not in pids
    assert (agent_dir.parent / "run" / "services" / "rollout-worker-1.log").is_file()


def test_a_killed_worker_fails_its_episode_alone_and_is_replaced(agent_dir, gateway):
    release = agent_dir.parent / "release"
    events: list[tuple[float, str]] = []

    async def scenario():
        on_event = lambda message: events.append((time.monotonic(), message))  # noqa: E731
        async with running_pool(agent_dir, gateway, on_event=on_event) as (pool, _):
            run = controller(pool, gateway)
            holds = [agent_dir.parent / f"hold-{n}" for n in range(2)]
            # One held episode on each worker (the least loaded takes the second).
            held = [
                asyncio.create_task(
                    run.run_one(
                        {"id": f"held{n}", "n": n, "hold": str(h), "release": str(release)}, f"g{n}"
                    )
                )
                for n, h in enumerate(holds)
            ]
            await until(lambda: all(h.exists() for h in holds), 60, "both episodes held")
            victim_pid = int(holds[0].read_text())
            victim = next(i for i, s in enumerate(pool.states()) if s.pid == victim_pid)
            killed_at = time.monotonic()
            pool.kill(victim)
            [lost] = await asyncio.wait_for(held[0], 30)
            release.write_text("")
            [kept] = await asyncio.wait_for(held[1], 30)
            state = pool.states()[victim]
            await until(lambda: state.phase == Phase.UP, 90, "the replacement up")
            later = await run.run(tasks(range(10, 14)))
            return victim, victim_pid, killed_at, lost, kept, state, later

    victim, victim_pid, killed_at, lost, kept, state, later = asyncio.run(scenario())
    label = f"rollout worker {victim}"
    assert lost.status == "failed" and lost.error == f"{label} died (exit -9); episode failed"
    assert gateway.store.get(lost.id).error == lost.error
    assert kept.status == "ok" and kept.reward == 1.0  # in flight on the other worker
    reported = [t for t, message in events if message.startswith(f"{label} died (exit -9)")]
    assert reported and reported[0] - killed_at <= 3.0  # within heartbeat_timeout_s
    assert state.pid != victim_pid and state.restarts == 1
    assert len(later.ok) == 4 and state.pid in {e.metadata["pid"] for e in later.episodes}


def test_a_stalled_worker_is_killed_and_replaced(agent_dir, gateway):
    release = agent_dir.parent / "release"
    hold = agent_dir.parent / "hold"
    events: list[str] = []

    async def scenario():
        async with running_pool(agent_dir, gateway, workers=1, on_event=events.append) as (
            pool,
            _,
        ):
            run = controller(pool, gateway)
            task = {"id": "held", "n": 1, "hold": str(hold), "release": str(release)}
            held = asyncio.create_task(run.run_one(task, "g"))
            await until(hold.exists, 60, "the episode held")
            stalled_pid = pool.states()[0].pid
            os.kill(stalled_pid, signal.SIGSTOP)  # alive, silent
            [lost] = await asyncio.wait_for(held, 30)
            state = pool.states()[0]
            await until(lambda: state.phase == Phase.UP, 90, "the replacement up")
            release.write_text("")
            later = await run.run(tasks(range(2)))
            return stalled_pid, lost, state, later

    stalled_pid, lost, state, later = asyncio.run(scenario())
    assert lost.status == "failed"
    assert lost.error.startswith("rollout worker 0 stalled (no heartbeat for ")
    assert events[0].startswith("rollout worker 0 stalled") and not _alive(stalled_pid)
    assert state.pid != stalled_pid and len(later.ok) == 2


def test_a_worker_that_keeps_dying_stops_the_run(agent_dir, gateway):
    async def scenario():
        policy = RestartPolicy(max_restarts=3, window_s=300)
        async with running_pool(agent_dir, gateway, workers=1, policy=policy) as (pool, watch):
            state = pool.states()[0]
            for kill in range(4):
                await until(lambda: state.phase == Phase.UP, 90, f"worker up before kill {kill}")
                pool.kill(0)
                await until(lambda: state.phase != Phase.UP, 30, f"kill {kill} seen")
            with pytest.raises(ServiceFailed) as failed:
                await asyncio.wait_for(watch, 30)
            return state, failed.value

    state, error = asyncio.run(scenario())
    assert error.service == "rollout-worker-0"
    assert "failed 4 times in 300 s" in str(error) and "died (exit -9)" in str(error)
    assert state.restarts == 3


def test_a_sync_agent_hanging_on_some_tasks_in_a_worker(agent_dir, gateway):
    async def scenario():
        async with running_pool(agent_dir, gateway, entry="workeragent:solve_sync") as (pool, _):
            return await controller(pool, gateway, timeout_s=5).run(tasks(range(20)))

    summary = asyncio.run(scenario())
    assert len(summary.ok) == 18, [e.error for e in summary.failed]
    assert sorted(e.task_id for e in summary.failed) == ["t0", "t10"]
    assert all(e.error == "TimeoutError: agent did not finish within 5 s" for e in summary.failed)
    assert all(e.reward == 0.5 and len(e.turns) == 1 for e in summary.ok)


def test_an_agent_that_cannot_be_imported_fails_start(agent_dir, gateway):
    (agent_dir / "broken.py").write_text("import not_a_module_anywhere\n")

    async def scenario():
        pool = AgentWorkerPool(
            "broken:solve",
            workers=2,
            search_path=[agent_dir],
            gateway_url=gateway.base_url,
            framework_telemetry=False,
            run_dir=agent_dir.parent / "run",
        )
        with pytest.raises(LaunchError) as failed:
            await pool.start()
        return pool, failed.value

    pool, error = asyncio.run(scenario())
    assert str(error).startswith("rollout worker ")
    assert "cannot load the agent" in str(error) and "not_a_module_anywhere" in str(error)
    assert all(s.phase == Phase.STOPPED and not _alive(s.pid) for s in pool.states())


def _alive(pid: int | None) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, TypeError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_workers_die_with_their_parent(agent_dir, gateway):
    pid_file = agent_dir.parent / "worker.pid"
    script = textwrap.dedent(
        f"""
        import asyncio
        from pathlib import Path
        from areal_sdk.services.agent_workers import AgentWorkerPool

        async def main():
            pool = AgentWorkerPool(
                "workeragent:solve", workers=1, search_path=[Path({str(agent_dir)!r})],
                gateway_url={gateway.base_url!r}, framework_telemetry=False,
                run_dir=Path({str(agent_dir.parent / "run")!r}),
            )
            await pool.start()
            Path({str(pid_file)!r}).write_text(str(pool.states()[0].pid))
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        worker_pid = int(pid_file.read_text())
        assert _alive(worker_pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid)
