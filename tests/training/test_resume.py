"""SIGKILL a real ``areal-sdk train`` mid-run and ``--resume`` it: no accepted episode is lost,
none is trained twice, and the run finishes its steps. Also which stored episodes a resumed
run queues, and which samples it must run to complete a group the crash cut short."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections import Counter

import pytest

from areal_sdk.checkpoints import Checkpoints
from areal_sdk.config import load_config
from areal_sdk.metrics import read_metrics
from areal_sdk.store import TrajectoryStore
from areal_sdk.training_run import TRAIN_RUN, TrainingRun, _leftover_groups
from areal_sdk.trajectory import Episode, EpisodeStatus, Turn
from tests.training.conftest import train_subprocess as _train


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
    # None was trained on samples of the weights that died with the first process.
    with TrajectoryStore(run_dir) as store:
        retrained = [store.get(i) for i, s in consumed.items() if s >= killed_at and i in before]
    assert all((e.max_version or 0) <= killed_at for e in retrained)
    # Accepted-but-untrained episodes from before the kill were trained first, if fresh.
    assert Checkpoints(run_dir).latest().step == 6


def _episode(group, sample=None, *, attempt=0, ok=True, start_version=2, sampled_by=None):
    metadata = {"start_version": start_version, "attempt": attempt}
    if sample is not None:
        metadata["sample"] = sample
    status = EpisodeStatus.OK if ok else EpisodeStatus.FAILED
    turns = (
        [
            Turn(
                api="openai.chat",
                prompt_ids=[1],
                completion_ids=[7, 8],
                logprobs=[-1.0, -1.0],
                versions=sampled_by,
            )
        ]
        if sampled_by
        else []
    )
    return Episode(
        task_id=f"task-{group}", group_id=group, status=status, metadata=metadata, turns=turns
    )


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
        # Sampled by weights newer than the checkpoint resumed from: they died with the process.
        "lost_weights": [_episode("lost_weights", 0, start_version=4), _episode("lost_weights", 1)],
        "lost_midway": [_episode("lost_midway", 0, sampled_by=[3, 4]), _episode("lost_midway", 1)],
        "sampled": [_episode("sampled", 0, sampled_by=[2, 3]), _episode("sampled", 1)],
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

    leftovers, lost_weights = _leftover_groups(
        store, checkpoint_step=3, checkpoint_version=3, max_staleness=2, group_size=2, retries=1
    )
    assert lost_weights == 4
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
        "sampled": (ids["sampled"], []),
        "old": (ids["old"], [1]),
        "old_retried": (ids["old_retried"][1:], []),
    }
    assert all(left.task_id == f"task-{left.group.group_id}" for left in leftovers)


@pytest.mark.slow
def test_a_resumed_run_never_reuses_the_version_of_weights_lost_with_the_process(run_config):
    """The newest checkpoint is lost (as if the process died before writing it): version 3
    sampled tokens, then died. The resumed run trains nothing on them and gives its own
    weights new numbers, so version 3 names one set of weights only."""
    config = run_config(run={"checkpoint_every": 1, "keep_optimizer_state": "all"})
    cfg = load_config(config)
    asyncio.run(TrainingRun(cfg, config_dir=config.parent).run())
    shutil.rmtree(Checkpoints(cfg.run.dir).latest().path)  # step 3, version 3
    with TrajectoryStore(cfg.run.dir) as store:
        before = {e.id for e in store.query()}
        assert store.highest_version() == 3

    result = asyncio.run(TrainingRun(cfg, config_dir=config.parent, resume=True).run())
    assert result.resumed_from == 2 and result.steps == 3
    assert result.version == 5  # the checkpoint's weights became 4, their update 5

    def versions(episode):
        return {v for turn in episode.turns for v in turn.versions}

    with TrajectoryStore(cfg.run.dir) as store:
        episodes = store.query(run_id=TRAIN_RUN)
        consumed = store.consumed_steps()
    assert all(3 not in versions(e) for e in episodes if e.id in consumed)
    assert all(3 not in versions(e) for e in episodes if e.id not in before)
    assert [r["weights/version"] for r in read_metrics(cfg.run.dir)] == [1, 2, 5]
