"""Ctrl-C or SIGTERM (a scheduler's warning before it kills) during a real ``areal-sdk train``:
the last finished step is checkpointed and the message says so; ``--resume`` then reads as
one run (each step logged once, the held-out reward before, after and the gain)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from areal_sdk.checkpoints import Checkpoints
from areal_sdk.metrics import read_metrics
from areal_sdk.store import TrajectoryStore
from tests.training.conftest import train_subprocess as _train


def _interrupt_after(config, steps: int, sig: signal.Signals) -> tuple[int, str]:
    """Train, send ``sig`` once ``steps`` steps are logged; the exit code and the output."""
    proc = _train(config)
    run_dir = config.parent / "run"
    deadline = time.monotonic() + 240
    while len(read_metrics(run_dir)) < steps:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{steps} steps not done within 240 s"
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_checkpoints_the_last_finished_step(run_config, sig):
    # No periodic checkpoints: before, everything trained since the start was lost.
    config = run_config(run={"steps": 200}, eval={"before": False, "after": False})
    run_dir = config.parent / "run"
    code, out = _interrupt_after(config, 2, sig)
    assert code == 128 + sig.value, out

    kept = Checkpoints(run_dir).latest()
    assert kept is not None and kept.step >= 2, out
    # The step in flight finished or was dropped: metrics and checkpoint agree.
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, kept.step + 1))
    assert f"interrupted by {sig.name}: checkpoint of step {kept.step}/200 kept" in out
    assert "continue with --resume" in out
    with TrajectoryStore(run_dir) as store:
        assert sorted(set(store.consumed_steps().values())) == list(range(kept.step))


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs
def test_interrupt_and_resume_reads_as_one_run(run_config):
    config = run_config(run={"steps": 200, "metric_sinks": ["jsonl", "tensorboard"]})
    run_dir = config.parent / "run"
    code, out = _interrupt_after(config, 2, signal.SIGINT)
    assert code == 130, out
    before = json.loads((run_dir / "eval.json").read_text())["before"]  # written at once
    assert "held-out reward before training:" in out
    kept = Checkpoints(run_dir).latest().step

    steps = kept + 2
    resumed = subprocess.run(
        [sys.executable, "-m", "areal_sdk", "train", str(config), f"run.steps={steps}", "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = resumed.stdout
    assert resumed.returncode == 0, out + resumed.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    assert f"step {steps}/{steps}" in out
    # The summary has the before of the first leg (not measured again), after and gain.
    assert f"held-out reward before: {before['mean']:.3f}" in out
    assert "held-out reward after:" in out and "gain:" in out
    with TrajectoryStore(run_dir) as store:
        assert store.count(run_id="eval-initial") == before["episodes"] == 4


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_still_checkpoints(run_config):
    """Slurm's scancel, `timeout` and a terminal's Ctrl-C signal every process of the group:
    the trainer in its own process must not die of it before the run checkpoints."""
    import os

    config = run_config(
        run={"steps": 200},
        train={"separate_process": True},
        eval={"before": False, "after": False},
    )
    run_dir = config.parent / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # a group of its own, as a job step's
    )
    try:
        deadline = time.monotonic() + 240
        while len(read_metrics(run_dir)) < 2:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "2 steps not done within 240 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out
    kept = Checkpoints(run_dir).latest()
    assert kept is not None and f"checkpoint of step {kept.step}/200 kept" in out, out
    assert "trainer died" not in out, out
