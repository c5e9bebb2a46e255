"""Engine servers as supervised processes: real ``areal-sdk engine`` processes with the tiny
model on loopback, killed with ``kill -9``, restarted, added and removed while requests run.

The tests share one fleet and run in file order: each leaves it as the next one expects
(the last one kills a server until the fleet gives up).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from areal_sdk.backends.sglang.launcher import LaunchError
from areal_sdk.backends.weight_sync.disk import write_hf_weights
from safetensors.torch import load_file

from areal_sdk.config import Config
from areal_sdk.inference import SamplingParams
from areal_sdk.services.engine_fleet import EngineFleet
from areal_sdk.services.health import Phase, RestartPolicy, ServiceFailed, ServiceState
from tests.backends.embedded.conftest import engine_server, make_engine
from tests.backends.sglang.conftest import FAKE_LAUNCH_SERVER

pytestmark = pytest.mark.slow

HEARTBEAT_S = 5.0  # generous: CI machines can be slow to answer under load
PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]
# Long enough to be seen running on an idle machine (the context is 256 tokens).
LONG = SamplingParams(max_new_tokens=240, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=4, ignore_eos=True)


class Recorder:
    """What the fleet reported, with when."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []

    def __call__(self, state: ServiceState, message: str) -> None:
        self.events.append((time.monotonic(), state.name, message))

    def first_after(self, since: float, name: str, text: str) -> float | None:
        hits = [t for t, n, m in self.events if t >= since and n == name and text in m]
        return hits[0] if hits else None


class Weights:
    """The trainer's side: versions of perturbed weights, as directories and as tensors."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.model_dir, self.root = model_dir, root
        self.base = load_file(str(model_dir / "model.safetensors"))
        self.latest: tuple[dict[str, torch.Tensor], int] | None = None

    def make(self, version: int) -> Path:
        gen = torch.Generator().manual_seed(version)
        tensors = {
            k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
            for k, v in self.base.items()
        }
        out = self.root / f"v{version}"
        write_hf_weights([list(tensors.items())], out, model_dir=self.model_dir)
        self.latest = (tensors, version)
        return out

    async def __call__(self) -> tuple[dict[str, torch.Tensor], int] | None:
        return self.latest


@pytest.fixture(scope="module")
def setup(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineFleet, Recorder, Weights, list[tuple[list[str], int]]]]:
    run_dir = tmp_path_factory.mktemp("fleet-run")
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "inference": {
                "servers": 2,
                "max_batch_size": 8,
                "max_model_len": 256,
                "prefill_chunk": 64,
                "launch_timeout_s": 240,
                "request_timeout_s": 120,
                "retries": 1,
            },
            "run": {"dir": str(run_dir)},
        }
    )
    recorder, weights = Recorder(), Weights(tiny_model_dir, run_dir / "pushed")
    changes: list[tuple[list[str], int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        fleet = EngineFleet(
            cfg,
            run_dir=run_dir,
            policy=RestartPolicy(max_restarts=3, window_s=300),
            heartbeat_timeout_s=HEARTBEAT_S,
            on_event=recorder,
            on_change=lambda urls, version: changes.append((list(urls), version)),
            latest_weights=weights,
        ).start()
    try:
        yield fleet, recorder, weights, changes
    finally:
        fleet.stop()


async def _watching(fleet: EngineFleet) -> asyncio.Task[None]:
    task = asyncio.create_task(fleet.watch(poll_s=0.5))
    await asyncio.sleep(0)
    return task


async def _until(
    predicate, timeout_s: float, what: str, watcher: asyncio.Task[None] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if watcher is not None and watcher.done():
            watcher.result()  # the watch's error, not a timeout
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _prompt_logprobs(url: str) -> list[float]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    meta = httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
    return [row[0] for row in meta["input_token_logprobs"][1:]]


def _served_version(url: str) -> str:
    return httpx.get(url + "/get_model_info", timeout=30).json()["weight_version"]


async def test_two_servers_serve_with_session_affinity(setup) -> None:
    fleet, _, _, _ = setup
    backend = fleet.backend
    assert [s["alive"] for s in backend.servers()] == [True, True]
    for i, state in enumerate(fleet.states()):
        assert (state.kind, state.phase, state.name) == ("engine", Phase.UP, f"engine-{i}")
        assert (Path(fleet.run_dir) / "services" / f"engine-{i}.log").is_file()
        assert state.pid and os.getpgid(state.pid) == state.pid  # its own process group
    # Concurrent first turns spread over both servers; each episode's later turns stay put.
    first = await asyncio.gather(
        *(backend.generate(PROMPT, LONG, request_id=f"ep{i}:0") for i in range(4))
    )
    assert {o.meta["server"] for o in first} == set(fleet.urls)
    later = await asyncio.gather(
        *(
            backend.generate(PROMPT, SHORT, request_id=f"ep{i}:{t}")
            for i in range(4)
            for t in (1, 2)
        )
    )
    for i in range(4):
        assert {o.meta["server"] for o in later[2 * i : 2 * i + 2]} == {first[i].meta["server"]}


async def test_kill_9_mid_generation_requests_finish_and_server_rejoins_at_latest(setup) -> None:
    fleet, recorder, weights, changes = setup
    backend = fleet.backend
    await backend.update_weights(weights.make(1), 1)  # the killed server must come back at 1
    watcher = await _watching(fleet)
    victim = fleet.members[0]
    running = [
        asyncio.create_task(backend.generate(PROMPT, LONG, request_id=f"kill{i}:0"))
        for i in range(6)
    ]
    await _until(
        lambda: any(s["url"] == victim.url and s["in_flight"] for s in backend.servers()),
        60,
        "requests running on engine-0",
    )
    old_pid = victim.state.pid
    killed_at = time.monotonic()
    fleet.kill(0)

    outs = await asyncio.gather(*running)  # none fails: they are re-sent to engine-1
    assert all(len(o.output_ids) == LONG.max_new_tokens for o in outs)
    assert {o.meta["server"] for o in outs} == {fleet.members[1].url}
    await _until(lambda: recorder.first_after(killed_at, "engine-0", "exited"), 30, "report")
    reported = recorder.first_after(killed_at, "engine-0", "exited")
    assert reported - killed_at < HEARTBEAT_S  # the bound; a kill is seen at the next probe
    assert changes[-1][0] == [fleet.members[1].url]  # the gateway was told at once

    await _until(lambda: victim.state.phase == Phase.UP, 240, "engine-0 back up")
    assert victim.state.pid != old_pid and victim.state.restarts == 1
    assert _served_version(victim.url) == "1"
    assert _prompt_logprobs(victim.url) == _prompt_logprobs(fleet.members[1].url)
    assert changes[-1] == (fleet.urls, 1) and len(fleet.urls) == 2
    assert (fleet.run_dir / "services" / "restart-weights").is_dir()  # tensors went by disk

    # A push after the restart reaches the restarted server too.
    before = _prompt_logprobs(victim.url)
    await backend.update_weights(weights.make(2), 2)
    assert {_served_version(u) for u in fleet.urls} == {"2"}
    assert _prompt_logprobs(victim.url) == _prompt_logprobs(fleet.members[1].url) != before
    await _stop(watcher)


async def test_stalled_server_is_restarted(setup) -> None:
    fleet, recorder, _, _ = setup
    victim = fleet.members[0]
    watcher = await _watching(fleet)
    stopped_at = time.monotonic()
    os.kill(victim.state.pid, signal.SIGSTOP)  # alive, but answers nothing
    await _until(
        lambda: recorder.first_after(stopped_at, "engine-0", "not answered"), 30, "stall", watcher
    )
    # Silent for the heartbeat timeout, plus at most one probe's wait.
    assert (
        recorder.first_after(stopped_at, "engine-0", "not answered") - stopped_at < 2 * HEARTBEAT_S
    )
    await _until(lambda: victim.state.phase == Phase.UP, 240, "engine-0 back up")
    assert victim.state.restarts == 2 and _served_version(victim.url) == "2"
    await _stop(watcher)


async def test_server_added_mid_run_serves_current_version_and_gets_requests(setup) -> None:
    fleet, _, _, changes = setup
    backend = fleet.backend
    running = [
        asyncio.create_task(backend.generate(PROMPT, LONG, request_id=f"add{i}:0"))
        for i in range(4)
    ]
    url = await fleet.add()
    assert url in fleet.urls and len(fleet.urls) == 3 and changes[-1] == (fleet.urls, 2)
    assert _served_version(url) == "2"
    assert _prompt_logprobs(url) == _prompt_logprobs(fleet.members[1].url)
    await asyncio.gather(*running)
    outs = await asyncio.gather(
        *(backend.generate(PROMPT, LONG, request_id=f"new{i}:0") for i in range(6))
    )
    assert url in {o.meta["server"] for o in outs}
    assert all(o.versions == [2] * LONG.max_new_tokens for o in outs)


async def test_removed_server_finishes_its_requests_and_gets_no_more(setup) -> None:
    fleet, _, _, changes = setup
    backend = fleet.backend
    leaving = fleet.members[-1]
    running = [
        asyncio.create_task(backend.generate(PROMPT, LONG, request_id=f"rm{i}:0")) for i in range(6)
    ]
    await _until(
        lambda: any(s["url"] == leaving.url and s["in_flight"] for s in backend.servers()),
        60,
        "requests running on the server to remove",
    )
    await fleet.remove(leaving.url)
    outs = await asyncio.gather(*running)  # none lost
    assert leaving.url in {o.meta["server"] for o in outs}
    assert all(len(o.output_ids) == LONG.max_new_tokens for o in outs)
    assert leaving.process.poll() is not None and leaving.url not in changes[-1][0]
    assert leaving.url not in [s["url"] for s in backend.servers()]
    # Its episodes' next turns, and new episodes, go to the servers left.
    after = await asyncio.gather(
        *(backend.generate(PROMPT, SHORT, request_id=f"rm{i}:1") for i in range(6)),
        *(backend.generate(PROMPT, SHORT, request_id=f"fresh{i}:0") for i in range(6)),
    )
    assert leaving.url not in {o.meta["server"] for o in after}


async def test_attached_server_is_brought_to_the_current_version(setup, tiny_model_dir) -> None:
    fleet, _, _, _ = setup
    engine = make_engine(tiny_model_dir)
    with engine_server(engine) as running:  # a server this fleet did not launch, at version 0
        await fleet.backend.pause()  # a weight push under way: it joins paused
        url = await fleet.add(running.url)
        assert (await engine.health())["paused"] is not None
        await fleet.backend.resume()
        assert (await engine.health())["paused"] is None
        assert _served_version(url) == "2" and url in fleet.urls
        # Another process's float reductions: equal to rounding.
        assert _prompt_logprobs(url) == pytest.approx(
            _prompt_logprobs(fleet.members[0].url), abs=1e-4
        )
        out = await fleet.backend.generate(PROMPT, SHORT, request_id="attached:0")
        assert out.versions == [2] * SHORT.max_new_tokens
        await fleet.remove(url)
        assert httpx.get(url + "/health").status_code == 200  # removed, but not ours to stop
    await engine.close()


async def test_server_that_keeps_dying_makes_watch_raise(setup) -> None:
    fleet, _, _, _ = setup
    victim = fleet.members[1]
    watcher = await _watching(fleet)
    started = time.monotonic()
    killed: set[int] = set()

    async def keep_killing() -> None:
        while not watcher.done():
            pid = victim.state.pid
            if pid not in killed and victim.process is not None and victim.process.poll() is None:
                killed.add(pid)
                fleet.kill(1)
            await asyncio.sleep(0.1)

    killer = asyncio.create_task(keep_killing())
    with pytest.raises(ServiceFailed, match="engine engine-1 failed 4 times"):
        await asyncio.wait_for(watcher, 60)
    killer.cancel()
    assert len(killed) == 4 and time.monotonic() - started < 60
    assert victim.state.phase == Phase.FAILED
    assert fleet.members[0].state.phase == Phase.UP  # the other server is untouched


def test_stop_ends_every_server_cleanly(setup) -> None:
    fleet, _, _, _ = setup
    survivor = fleet.members[0]
    assert survivor.process.poll() is None
    fleet.stop()
    assert survivor.process.returncode == 0  # SIGTERM: areal-sdk engine shuts down, exit 0
    assert all(s.phase == Phase.STOPPED for s in [survivor.state]) and fleet.members == []


def test_a_server_that_cannot_start_fails_start_with_its_log(tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {"model": {"path": str(tmp_path / "no-such-model")}, "run": {"dir": str(tmp_path)}}
    )
    with pytest.raises(
        LaunchError, match=r"engine-0 exited with code 2 while starting(.|\n)*no-such-model"
    ):
        EngineFleet(cfg, servers=1).start()
    assert (tmp_path / "services" / "engine-0.log").is_file()


async def test_sglang_servers_are_launched_and_restarted_the_same_way(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``inference.backend: sglang`` launches ``sglang.launch_server`` (a stand-in here:
    SGLang cannot run on these machines) and supervises it as any engine server."""
    fake = tmp_path / "fake-sglang"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "inference": {
                "backend": "sglang",
                "sglang_python": sys.executable,
                "launch_timeout_s": 240,
                "retries": 1,
            },
            "run": {"dir": str(tmp_path / "run")},
        }
    )
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(fake))
        mp.setenv("OMP_NUM_THREADS", "1")
        fleet = EngineFleet(cfg, servers=1, heartbeat_timeout_s=HEARTBEAT_S, on_event=recorder)
        fleet.start()
        try:
            log = (tmp_path / "run" / "services" / "engine-0.log").read_text()
            assert "fake sglang.launch_server" in log
            assert (await fleet.backend.generate(PROMPT, SHORT)).output_ids
            watcher = await _watching(fleet)
            fleet.kill(0)
            await _until(
                lambda: recorder.first_after(0, "engine-0", "serves again"), 240, "restart", watcher
            )
            assert (await fleet.backend.generate(PROMPT, SHORT)).output_ids
            await _stop(watcher)
        finally:
            fleet.stop()
