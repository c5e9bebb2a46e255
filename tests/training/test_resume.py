"""SIGKILL a real ``areal-sdk train`` mid-run and ``--resume`` it: no accepted episode is lost,
none is trained twice, and the run finishes its steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from areal_sdk.checkpoints import Checkpoints
from areal_sdk.store import TrajectoryStore


def _train(config, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "train", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.slow
def test_sigkill_then_resume_loses_nothing_and_trains_nothing_twice(run_config):
    config = run_config(
        run={"steps": 6, "checkpoint_every": 1},
        rollout={"max_staleness": 2},
        eval={"before": False, "after": False},
    )
    run_dir = config.parent / "run"
    first = _train(config)
    deadline = time.monotonic() + 240
    ckpts = Checkpoints(run_dir)
    while (latest := ckpts.latest()) is None or latest.step < 3:
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint at step 3 within 240 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()

    with TrajectoryStore(run_dir) as store:
        before = {e.id for e in store.query(run_id="train")}
        consumed_before = store.consumed_steps()
    killed_at = Checkpoints(run_dir).latest().step
    assert 3 <= killed_at < 6

    second = _train(config, "--resume")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert f"resumed from step {killed_at}" in out

    with TrajectoryStore(run_dir) as store:
        after = {e.id for e in store.query(run_id="train")}
        consumed = store.consumed_steps()
    assert before <= after  # every accepted episode is still there
    # Steps before the checkpoint keep their episodes; later marks were released and redone.
    kept = {i: s for i, s in consumed_before.items() if s < killed_at}
    assert {i: s for i, s in consumed.items() if s < killed_at} == kept
    # Each of the 6 steps trained one batch; an episode has one mark, so none twice.
    assert Counter(consumed.values()) == {s: 4 for s in range(6)}
    # Accepted-but-untrained episodes from before the kill were trained first, if fresh.
    assert Checkpoints(run_dir).latest().step == 6
