"""The gateway as a supervised process: sessions over HTTP, kills, restarts, engine changes.

A real engine server (``python -m areal_sdk engine`` with the tiny model) and real gateway
processes on loopback, driven with the official ``openai`` SDK through ``HttpSessions``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from areal_sdk.config import Config
from areal_sdk.gateway import create_app
from areal_sdk.launcher import LaunchError
from areal_sdk.server_thread import ServerThread, bind_tcp
from areal_sdk.services.gateway_process import GatewayProcess
from areal_sdk.services.health import Phase, RestartPolicy, ServiceFailed
from areal_sdk.services.http_sessions import (
    GATEWAY_LOST_SESSION,
    GatewayUnavailable,
    HttpSessions,
)
from areal_sdk.store import TrajectoryStore
from areal_sdk.tracing import EpisodeContext
from areal_sdk.trajectory import Episode, EpisodeStatus

ADMIN = "test-admin-token"
HEARTBEAT_S = 3.0
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One embedded engine server, a process of its own, as ``areal-sdk engine`` runs it."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("engine") / "engine.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_sdk",
            "engine",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--max-batch-size",
            "8",
            "--max-model-len",
            "256",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"the engine server exited: {log.name}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the engine server did not start"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _config(model_dir: Path, run_dir: Path) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "inference": {
                "backend": "sglang",
                "max_new_tokens": 8,
                "request_timeout_s": 60,
                "retries": 1,
            },
            "run": {"dir": str(run_dir)},
        }
    )


class Run:
    """A run directory with its store, and a gateway process over the engine server."""

    def __init__(self, model_dir: Path, run_dir: Path, engine_url: str, policy: RestartPolicy):
        self.dir = run_dir
        self.store = TrajectoryStore(run_dir / "trajectories.db")
        self.sock = bind_tcp("127.0.0.1", 0)
        self.events: list[str] = []
        self.gateway = GatewayProcess(
            _config(model_dir, run_dir),
            run_dir=run_dir,
            store_path=self.store.path,
            engine_urls=[engine_url],
            version=0,
            admin_token=ADMIN,
            sock=self.sock,
            policy=policy,
            heartbeat_timeout_s=HEARTBEAT_S,
            on_event=lambda state, message: self.events.append(message),
        )
        self.sessions = HttpSessions(self.gateway.url, ADMIN, self.store, run_id="train")

    def close(self) -> None:
        self.gateway.stop()
        self.sock.close()
        self.store.close()


@pytest.fixture
def run(tiny_model_dir: Path, tmp_path: Path, engine_url: str) -> Iterator[Run]:
    r = Run(tiny_model_dir, tmp_path / "run", engine_url, RestartPolicy(3, 300))
    r.gateway.start()
    yield r
    r.close()


async def _open(run: Run, task_id: str) -> tuple[EpisodeContext, openai.AsyncOpenAI]:
    episode = Episode(task_id=task_id, group_id=f"grp-{task_id}")
    key = await run.sessions.open(episode)
    ctx = EpisodeContext(episode=episode, name="agent", base_url=run.gateway.url, api_key=key)
    client = openai.AsyncOpenAI(base_url=run.gateway.url + "/v1", api_key=key, max_retries=0)
    return ctx, client


async def _chat(client: openai.AsyncOpenAI) -> str | None:
    r = await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    return r.choices[0].message.content


async def _until(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_an_episode_over_http_sessions_is_stored_with_its_turns(run: Run) -> None:
    ctx, client = await _open(run, "t-ok")
    await _chat(client)
    live = httpx.get(
        f"{run.gateway.url}/rl/sessions/{ctx.id}", headers={"Authorization": f"Bearer {ADMIN}"}
    ).json()
    ctx.turn_rewards[live["turns"][0]["id"]] = 0.25  # areal.reward(0.25, turn=...)
    ctx.episode.reward = 1.0
    stored = await run.sessions.end(ctx)
    assert stored.status == EpisodeStatus.OK and stored.reward == 1.0
    assert len(stored.turns) == 1 and stored.turns[0].completion_ids
    assert stored.turns[0].reward == 0.25
    assert stored.metadata["run_id"] == "train"
    assert run.store.get(ctx.id).turns[0].prompt_ids == stored.turns[0].prompt_ids
    # An agent that ends its own session: that end stands, a reward given after is unused.
    ctx, client = await _open(run, "t-self-ended")
    await _chat(client)
    r = httpx.post(
        f"{run.gateway.url}/rl/sessions/{ctx.id}/end",
        json={"reward": 0.3},
        headers={"Authorization": f"Bearer {ctx.api_key}"},
    )
    assert r.status_code == 200
    ctx.episode.reward = 1.0
    stored = await run.sessions.end(ctx)
    assert stored.status == EpisodeStatus.OK and stored.reward == 0.3 and len(stored.turns) == 1
    await run.sessions.aclose()
    log = (run.dir / "services" / "gateway.log").read_text()
    assert "starting the gateway" in log


@pytest.mark.slow
async def test_killed_gateway_restarts_on_its_url_and_its_open_episode_fails_alone(
    run: Run,
) -> None:
    url, pid = run.gateway.url, run.gateway.state.pid
    lost, old_client = await _open(run, "t-lost")
    await _chat(old_client)
    watcher = asyncio.create_task(run.gateway.watch())
    try:
        run.gateway.kill()  # kill -9
        await _until(lambda: run.gateway.state.restarts == 1, "the kill is seen")
        await _until(lambda: run.gateway.state.phase == Phase.UP, "the gateway is back")
        assert run.gateway.url == url and run.gateway.state.pid != pid
        assert any("exited with code -9" in e for e in run.events)
        # The agent's next call, on the same address: its key died with the old gateway.
        with pytest.raises(openai.AuthenticationError):
            await _chat(old_client)
        lost.episode.reward = 1.0
        failed = await run.sessions.end(lost)
        assert failed.status == EpisodeStatus.FAILED
        assert failed.error.startswith(GATEWAY_LOST_SESSION)
        assert run.store.get(lost.episode.id).status == EpisodeStatus.FAILED
        # A new episode on the restarted gateway works.
        ctx, client = await _open(run, "t-after")
        await _chat(client)
        ctx.episode.reward = 0.5
        stored = await run.sessions.end(ctx)
        assert stored.status == EpisodeStatus.OK and len(stored.turns) == 1
        assert run.store.count() == 2
        assert not watcher.done()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await run.sessions.aclose()


@pytest.mark.slow
async def test_a_gateway_that_keeps_dying_stops_the_run(run: Run) -> None:
    watcher = asyncio.create_task(run.gateway.watch())
    try:
        # A stalled gateway (stopped, not dead) is found by its silence on /health.
        run.gateway.kill(signal.SIGSTOP)
        await _until(lambda: run.gateway.state.restarts == 1, "the stall is seen")
        assert any(f"did not answer /health for {HEARTBEAT_S:g} s" in e for e in run.events)
        for n in (2, 3):
            await _until(lambda: run.gateway.state.phase == Phase.UP, "the gateway is back")
            run.gateway.kill()
            await _until(lambda n=n: run.gateway.state.restarts == n, f"restart {n}")
        await _until(lambda: run.gateway.state.phase == Phase.UP, "the gateway is back")
        run.gateway.kill()
        with pytest.raises(ServiceFailed, match="gateway failed 4 times in 300 s"):
            await asyncio.wait_for(watcher, 60)
        assert run.gateway.state.phase == Phase.FAILED
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


@pytest.mark.slow
async def test_admin_engines_route_needs_the_token_and_a_good_body(run: Run) -> None:
    route = run.gateway.url + "/rl/admin/engines"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.put(route, json={"servers": ["http://127.0.0.1:1"], "version": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.get(route, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await http.put(route, content=b"{not json", headers=admin)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        for body, param in [
            ({"servers": "http://127.0.0.1:1", "version": 1}, "servers"),
            ({"servers": [], "version": 1}, "servers"),
            ({"servers": ["ftp://x"], "version": 1}, "servers"),
            ({"servers": ["http://127.0.0.1:1"], "version": "1"}, "version"),
            ({"servers": ["http://127.0.0.1:1"], "version": -1}, "version"),
            ({"servers": ["http://127.0.0.1:1"], "version": 1, "extra": 1}, "extra"),
        ]:
            r = await http.put(route, json=body, headers=admin)
            assert r.status_code == 422, body
            assert r.json()["error"]["param"] == param, body


class FixedEngine:
    """A stand-in engine, in process, that serves a fixed set of servers (no HTTP)."""

    version = 2

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer

    async def health(self) -> dict[str, object]:
        return {"status": "ok"}


class ElasticEngine(FixedEngine):
    """A stand-in for an engine over servers' URLs that can change them."""

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self.urls = ["http://127.0.0.1:30000"]

    def servers(self) -> list[str]:
        return list(self.urls)

    async def set_servers(self, urls: list[str], version: int) -> None:
        if version != self.version:
            raise ValueError(f"the servers serve version {self.version}, not {version}")
        self.urls = list(urls)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _serve(engine: object) -> ServerThread:
    from tests.gateway.conftest import gateway_host

    app = create_app(engine, admin_token=ADMIN, host=gateway_host())  # type: ignore[arg-type]
    return ServerThread(app, name="gateway")


def test_put_admin_engines_hands_the_engine_its_new_servers(tokenizer: object) -> None:
    engine = ElasticEngine(tokenizer)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    urls = ["http://127.0.0.1:30000", "http://127.0.0.1:30001/"]
    with _serve(engine) as server:
        route = server.url + "/rl/admin/engines"
        r = httpx.put(route, json={"servers": urls, "version": 2}, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json() == {"servers": [u.rstrip("/") for u in urls], "version": 2}
        assert engine.urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
        assert httpx.get(route, headers=admin).json()["servers"] == engine.urls
        # A server at another weight version is refused by the engine: 400, nothing changes.
        r = httpx.put(route, json={"servers": urls[:1], "version": 5}, headers=admin)
        assert r.status_code == 400 and "version 2, not 5" in r.json()["error"]["message"]
        assert len(engine.urls) == 2


def test_admin_engines_on_an_engine_with_fixed_servers_is_a_conflict(tokenizer: object) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with _serve(FixedEngine(tokenizer)) as server:
        route = server.url + "/rl/admin/engines"
        r = httpx.put(route, json={"servers": ["http://127.0.0.1:1"], "version": 0}, headers=admin)
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
        assert httpx.get(route, headers=admin).status_code == 409


STORE_WRITER = """
import sys
from areal_sdk.store import TrajectoryStore
from areal_sdk.trajectory import Episode

store = TrajectoryStore(sys.argv[1])
for i in range(int(sys.argv[3])):
    store.append(Episode(task_id=f"{sys.argv[2]}-{i}"), run_id="train")
"""


def test_two_processes_write_one_store_at_once(tmp_path: Path) -> None:
    """The gateway process stores episodes while the run's process stores failed ones."""
    path = tmp_path / "trajectories.db"
    TrajectoryStore(path).close()
    writers = [
        subprocess.Popen([sys.executable, "-c", STORE_WRITER, str(path), name, "40"])
        for name in ("gateway", "run")
    ]
    assert [w.wait(120) for w in writers] == [0, 0]
    with TrajectoryStore(path) as store:
        assert store.count() == 80


PARENT = """
import sys, time
from pathlib import Path
from areal_sdk.config import Config
from areal_sdk.server_thread import bind_tcp
from areal_sdk.services.gateway_process import GatewayProcess

run = Path(sys.argv[2])
cfg = Config.model_validate({"model": {"path": sys.argv[1]}, "inference": {"backend": "sglang"}})
gateway = GatewayProcess(
    cfg, run_dir=run, store_path=run / "trajectories.db", engine_urls=[sys.argv[3]],
    version=0, admin_token="t", sock=bind_tcp("127.0.0.1", 0),
).start()
print(gateway.state.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # dead, waiting for whoever adopted it to reap it


@pytest.mark.slow
def test_the_gateway_dies_with_its_parent(
    tiny_model_dir: Path, tmp_path: Path, engine_url: str
) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model_dir), str(tmp_path), engine_url],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert not _gone(child)
        parent.kill()  # kill -9: no atexit, no cleanup of its own
        parent.wait(30)
        deadline = time.monotonic() + 30
        while not _gone(child):
            assert time.monotonic() < deadline, "the gateway outlived its parent"
            time.sleep(0.2)
    finally:
        parent.kill()


async def test_an_episode_whose_gateway_is_down_fails_alone_and_is_stored(
    tmp_path: Path,
) -> None:
    port = _free_port()  # nothing listens there
    with TrajectoryStore(tmp_path / "trajectories.db") as store:
        sessions = HttpSessions(f"http://127.0.0.1:{port}", ADMIN, store, open_wait_s=0.5)
        episode = Episode(task_id="t-down")
        with pytest.raises(GatewayUnavailable, match="did not answer within 0.5 s"):
            await sessions.open(episode)
        ctx = EpisodeContext(episode=episode, name="agent", api_key="k")
        episode.error = "APIConnectionError: Connection error."
        stored = await sessions.end(ctx)
        await sessions.aclose()
        assert stored.status == EpisodeStatus.FAILED
        assert stored.error.startswith(GATEWAY_LOST_SESSION)
        assert "APIConnectionError" in stored.error  # the agent's own error, after it
        assert store.get(episode.id).status == EpisodeStatus.FAILED


@pytest.mark.slow
def test_a_gateway_that_exits_while_starting_fails_with_its_log(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    nowhere = f"http://127.0.0.1:{_free_port()}"  # no engine server there
    with bind_tcp("127.0.0.1", 0) as sock:
        gateway = GatewayProcess(
            _config(tiny_model_dir, tmp_path),
            run_dir=tmp_path,
            store_path=tmp_path / "trajectories.db",
            engine_urls=[nowhere],
            version=0,
            admin_token=ADMIN,
            sock=sock,
        )
        with pytest.raises(LaunchError, match="exited with code 1 while starting") as err:
            gateway.start()
        assert "cannot reach its engine servers: no SGLang server left" in str(err.value)
        assert nowhere in str(err.value)
        assert gateway.state.phase == Phase.FAILED
        assert gateway.state.pid is not None and _gone(gateway.state.pid)
