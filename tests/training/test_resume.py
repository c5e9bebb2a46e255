"""SIGKILL a real ``areal-sdk train`` mid-run and ``--resume`` it: no accepted episode is lost,
none is trained twice, and the run finishes its steps. Also which stored episodes a resumed
run queues, and which samples it must run to complete a group the crash cut short."""

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
from areal_sdk.training_run import TRAIN_RUN, _leftover_groups
from areal_sdk.trajectory import Episode, EpisodeStatus


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


def _episode(group, sample=None, *, attempt=0, ok=True, start_version=2):
    metadata = {"start_version": start_version, "attempt": attempt}
    if sample is not None:
        metadata["sample"] = sample
    status = EpisodeStatus.OK if ok else EpisodeStatus.FAILED
    return Episode(task_id=f"task-{group}", group_id=group, status=status, metadata=metadata)


def test_leftovers_keep_final_attempts_and_list_the_samples_a_crash_cut_short(tmp_path):
    store = TrajectoryStore(tmp_path, run_id=TRAIN_RUN)
    eps = {
        "whole": [_episode("whole", 0), _episode("whole", 1)],
        # Sample 1 finished; sample 0 was still running when the process died.
        "partial": [_episode("partial", 1)],
        # Sample 0 failed once, then succeeded: only its last attempt is in the group.
        "retried": [
            _episode("retried", 0, ok=False),
            _episode("retried", 1),
            _episode("retried", 0, attempt=1),
        ],
        # Sample 0 failed with a retry left and was killed before retrying: cut short too.
        "mid_retry": [_episode("mid_retry", 0, ok=False), _episode("mid_retry", 1)],
        # Out of retries: the failed attempt is final and stays in its group.
        "failed": [_episode("failed", 0, ok=False, attempt=1), _episode("failed", 1)],
        # Trained; its first attempt of sample 1 failed and was never consumed.
        "trained": [
            _episode("trained", 0),
            _episode("trained", 1, ok=False),
            _episode("trained", 1, attempt=1),
        ],
        "stale": [_episode("stale", 0, start_version=0)],
        # Stored before samples were numbered: one sample each, in order.
        "old": [_episode("old")],
        "old_retried": [
            _episode("old_retried", ok=False),
            _episode("old_retried", attempt=1),
            _episode("old_retried"),
        ],
    }
    store.append_many([e for group in eps.values() for e in group])
    store.append(_episode("eval", 0), run_id="eval-initial")  # not the training run's
    store.mark_consumed([eps["trained"][0].id, eps["trained"][2].id], step=1)

    leftovers = _leftover_groups(store, oldest_version=1, group_size=2, retries=1)
    got = {
        left.group.group_id: ([e.id for e in left.group.episodes], left.missing)
        for left in leftovers
    }
    ids = {g: [e.id for e in group] for g, group in eps.items()}
    assert got == {
        "whole": (ids["whole"], []),
        "partial": (ids["partial"], [0]),
        "retried": ([ids["retried"][2], ids["retried"][1]], []),
        "mid_retry": ([ids["mid_retry"][1]], [0]),
        "failed": (ids["failed"], []),
        "old": (ids["old"], [1]),
        "old_retried": (ids["old_retried"][1:], []),
    }
    assert all(left.task_id == f"task-{left.group.group_id}" for left in leftovers)
