"""``run.placement=processes`` end to end: a real ``areal-sdk train`` with two engine servers,
two rollout workers, the gateway and the trainer each in a process of its own, on the tiny
model. Each kind of service is killed with SIGKILL mid-run: the run goes on (or, for the
trainer, stops saying how to resume), the death is reported within the heartbeat bound, and
the store shows nothing trained twice."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from areal_sdk.cli.status import live_services
from areal_sdk.metrics import read_metrics
from areal_sdk.rollout import STOPPED_STALE
from areal_sdk.store import TrajectoryStore
from tests.training.conftest import train_subprocess
from tests.training.test_loop import SLOW_FIRST_TASK

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BOUND_S = 5.0  # run.heartbeat_timeout_s in these runs

HANGING_AGENT = """
import threading

import areal_sdk as areal
from openai import OpenAI


import os
from pathlib import Path

calls = 0


@areal.trace
def solve(task):
    global calls
    calls += 1
    if calls % 10 == 1:  # one call in ten (each worker's first) hangs for good
        (Path(__file__).parent / f"hung-{os.getpid()}-{calls}").touch()
        threading.Event().wait()
    reply = OpenAI().chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=6,
    )
    return float(len(reply.choices[0].message.content or "") % 3 == 0)
"""


class LiveRun:
    """``areal-sdk train`` in a subprocess, its output lines read as they come, with times."""

    def __init__(self, config: Path, *args: str) -> None:
        self.run_dir = config.parent / "run"
        self.proc: subprocess.Popen[str] = train_subprocess(config, *args)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, what: str, predicate: Any, timeout_s: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                self._reader.join(10)  # the last lines, then one more look
                value = predicate()
                assert value, f"the run exited waiting for {what}:\n{self.output}"
                return value
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout_s:g} s:\n{self.output}")

    def steps(self) -> int:
        return len(read_metrics(self.run_dir))

    def services(self) -> list[dict[str, Any]]:
        try:
            _, services = live_services(self.run_dir)
        except (FileNotFoundError, ValueError):
            return []
        return services or []

    def service(self, kind: str, index: int = 0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            matching = [s for s in self.services() if s["kind"] == kind and s["phase"] == "up"]
            return matching[index] if len(matching) > index and matching[index]["pid"] else None

        return dict(self.wait_for(f"a live {kind} service", found))

    def line_after(self, since: float, pattern: str) -> float:
        """Seconds from ``since`` to the first output line matching ``pattern``."""
        regex = re.compile(pattern, re.IGNORECASE)

        def seen() -> float | None:
            for when, line in self.lines:
                if when >= since and regex.search(line):
                    return when - since
            return None

        return float(self.wait_for(f"a line matching {pattern!r}", seen, timeout_s=60))

    def finish(self, timeout_s: float = 600.0) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(10)
        return code


def _processes_config(run_config: Any, steps: int = 6, **sections: dict) -> Path:
    settings: dict[str, dict] = {
        "run": {
            "steps": steps,
            "placement": "processes",
            "heartbeat_timeout_s": BOUND_S,
            "checkpoint_every": 1,
        },
        "inference": {"servers": 2},
        "rollout": {"workers": 2, "retries": 1, "timeout_s": 60},
        "eval": {"before": False, "after": False},
    }
    for name, values in sections.items():
        settings.setdefault(name, {}).update(values)
    return run_config(**settings)


def _assert_trained_once(run_dir: Path, steps: int, batch_size: int = 4) -> None:
    """Every step trained ``batch_size`` episodes, and no episode trained in two steps."""
    with TrajectoryStore(run_dir) as store:
        consumed = store.consumed_steps()
    per_step = Counter(consumed.values())
    assert sorted(per_step) == list(range(steps)), per_step
    assert all(n == batch_size for n in per_step.values()), per_step
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))


def _kill_mid_run(run: LiveRun, kind: str) -> tuple[dict[str, Any], float]:
    run.wait_for("the first step", lambda: run.steps() >= 1)
    victim = run.service(kind)
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    return victim, killed_at


def test_a_processes_run_trains_with_two_engines_and_two_workers(run_config):
    config = _processes_config(run_config, steps=3)
    run = LiveRun(config)

    def all_up() -> list[dict[str, Any]] | None:
        services = [s for s in run.services() if s["phase"] == "up"]
        return services if len(services) >= 6 else None

    services = run.wait_for("every service up", all_up)
    kinds = Counter(s["kind"] for s in services)
    assert kinds == {"engine": 2, "gateway": 1, "rollout_worker": 2, "trainer": 1}, services
    assert len({s["pid"] for s in services}) == 6  # each a process of its own
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 3)
    status = subprocess.run(
        ["areal-sdk", "status", str(run.run_dir)], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and "ended" in status.stdout and "engine-0" in status.stdout


@pytest.mark.parametrize("kind", ["engine", "rollout_worker", "gateway"])
def test_a_killed_service_is_restarted_and_the_run_finishes(run_config, kind):
    config = _processes_config(run_config)
    run = LiveRun(config)
    victim, killed_at = _kill_mid_run(run, kind)
    # Named in the progress output within the bound (plus a poll interval).
    name = re.escape(victim["name"]).replace(r"\-", "[- ]")  # rollout-worker-0 or ... worker 0
    assert run.line_after(killed_at, name) <= BOUND_S + 3, run.output
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 6)
    recorded, _ = live_services(run.run_dir)  # the run has ended: its last states
    states = {s["name"]: s for s in recorded["services"]}
    assert states[victim["name"]]["restarts"] >= 1, states


def test_a_killed_trainer_stops_the_run_with_the_resume_hint(run_config):
    config = _processes_config(run_config, steps=50)
    run = LiveRun(config)
    _, killed_at = _kill_mid_run(run, "trainer")
    assert run.line_after(killed_at, "trainer") <= BOUND_S + 3, run.output
    assert run.finish(120) == 1, run.output
    errors = [line for _, line in run.lines if line.startswith("error:")]
    assert len(errors) == 1, run.output
    assert "trainer" in errors[0] and "--resume" in errors[0], errors
    assert "Traceback" not in run.output


def test_an_engine_that_keeps_dying_stops_the_run(run_config):
    config = _processes_config(run_config, steps=200, run={"max_restarts": 2})
    run = LiveRun(config)
    run.wait_for("the first step", lambda: run.steps() >= 1)
    started = time.monotonic()
    killed: set[int] = set()
    while run.proc.poll() is None and time.monotonic() - started < 120:
        engines = [s for s in run.services() if s["name"] == "engine-0" and s["pid"]]
        if engines and engines[0]["phase"] == "up" and engines[0]["pid"] not in killed:
            killed.add(engines[0]["pid"])
            os.kill(engines[0]["pid"], signal.SIGKILL)
        time.sleep(0.2)
    assert run.finish(60) == 1, run.output
    assert time.monotonic() - started < 60 + 60  # restarts take their start-up time
    errors = [line for _, line in run.lines if line.startswith("error:")]
    assert len(errors) == 1 and "engine-0" in errors[0], run.output


def test_a_sync_agent_that_hangs_on_some_tasks_does_not_stop_the_run(run_config, tmp_path):
    config = _processes_config(
        run_config, steps=3, rollout={"timeout_s": 5, "retries": 0, "max_staleness": 2}
    )
    (tmp_path / "toy_agent.py").write_text(HANGING_AGENT)
    run = LiveRun(config)
    assert run.finish(600) == 0, run.output
    _assert_trained_once(run.run_dir, 3)
    # Calls did hang (the run may end before their timeout stores them as failed).
    assert list(tmp_path.glob("hung-*")), "no call hung"


def test_an_engine_added_mid_run_serves_the_current_weights(run_config):
    config = _processes_config(run_config, steps=40, inference={"servers": 1})
    run = LiveRun(config)
    run.wait_for("the first step", lambda: run.steps() >= 1)
    added = subprocess.run(
        ["areal-sdk", "engines", "add", str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert added.returncode == 0, added.stdout + added.stderr
    url = added.stdout.strip().split()[-1]
    import httpx

    def served() -> bool:
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        return int(info["stats"]["sampled_tokens"]) > 0

    run.wait_for("requests on the added server", served, timeout_s=120)
    version = int(httpx.get(url + "/get_model_info", timeout=10).json()["weight_version"])
    assert version >= 1  # trained weights, not the initial ones
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 40)


def test_a_trainer_that_cannot_load_stops_the_services_starting_beside_it(run_config):
    """Under ``processes`` the engine servers and the gateway start while the trainer loads;
    a trainer that fails to load takes them down before the run's error reaches the caller,
    even in a process that lives on (no lifeline ends them then)."""
    import asyncio

    import psutil

    from areal_sdk.config import load_config
    from areal_sdk.training_run import TrainingRun

    path = run_config(
        run={"steps": 2, "placement": "processes"},
        train={"lora": {"target_modules": ["no_such_module"]}},
        eval={"before": False, "after": False},
    )
    run = TrainingRun(load_config(path), config_dir=path.parent)

    async def fail_and_look() -> list[str]:
        with pytest.raises(Exception, match="no_such_module"):
            await run.run()
        # Still on the run's loop, which would otherwise finish whatever was left starting.
        children = psutil.Process().children(recursive=True)
        _, alive = await asyncio.to_thread(psutil.wait_procs, children, timeout=15)
        return [" ".join(p.cmdline()) for p in alive if "areal_sdk" in " ".join(p.cmdline())]

    assert asyncio.run(fail_and_look()) == []
    engine_log = path.parent / "run" / "services" / "engine-0.log"
    assert engine_log.is_file()  # the engine server did start beside the trainer


def test_a_group_that_can_no_longer_be_trained_stops_in_its_worker(run_config, tmp_path):
    config = _processes_config(run_config, steps=4, rollout={"max_staleness": 1})
    (tmp_path / "toy_agent.py").write_text(SLOW_FIRST_TASK)  # each worker's first task hangs
    run = LiveRun(config)
    assert run.finish(600) == 0, run.output
    _assert_trained_once(run.run_dir, 4)
    with TrajectoryStore(run.run_dir) as store:
        failed = [e for e in store.query(run_id="train") if e.status != "ok"]
    # The workers cancelled the hung agents when their groups went stale, mid-run: an episode
    # still running when the run ends is never stored.
    assert failed and all(e.error == STOPPED_STALE for e in failed), failed
    assert read_metrics(run.run_dir)[-1]["rollout/stopped_stale"] == len(failed)
