"""The whole loop on a tiny real model: engine, gateway, rollouts, trainer, weight pushes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from areal_sdk.config import load_config
from areal_sdk.rollout import STOPPED_STALE
from areal_sdk.store import TrajectoryStore
from areal_sdk.training_run import RunError, TrainingRun
from areal_sdk.trajectory import Episode, EpisodeStatus


def _run(config_path, *overrides, resume=False):
    cfg = load_config(config_path, list(overrides))
    run = TrainingRun(cfg, config_dir=config_path.parent, resume=resume)
    return cfg, asyncio.run(run.run())


def _consumed(cfg):
    """The store, and (episode, step that trained it) for every consumed episode."""
    store = TrajectoryStore(cfg.run.dir)
    steps = store.consumed_steps()
    return store, [(store.get(i), s) for i, s in steps.items()]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_a_short_run_trains_pushes_and_respects_the_staleness_bound(run_config, max_staleness):
    cfg, result = _run(run_config(rollout={"max_staleness": max_staleness}))
    assert result.steps == 3 and result.version == 3
    assert [r.step for r in result.reports] == [1, 2, 3]
    # The engine serves each pushed version: the trained policy's eval tokens carry the last.
    store, consumed = _consumed(cfg)
    evaluated = store.query(run_id="eval-trained")
    assert {v for e in evaluated for t in e.turns for v in t.versions} == {3}
    # Each step trained exactly one batch of whole groups, marked in the store.
    per_step = Counter(step for _, step in consumed)
    assert per_step == {0: 4, 1: 4, 2: 4}
    for episode, step in consumed:
        staleness = step - episode.metadata["start_version"]
        assert 0 <= staleness <= max_staleness
        for turn in episode.turns:  # no token is older than the episode's start version
            assert min(turn.versions) >= episode.metadata["start_version"]
    if max_staleness == 0:
        assert all(step == e.metadata["start_version"] for e, step in consumed)
        for episode, step in consumed:  # synchronous: sampled by exactly the step's weights
            assert {v for t in episode.turns for v in t.versions} == {step}
    # Held-out evaluation before and after, metrics and the reward curve in the run dir.
    assert result.before is not None and result.after is not None
    assert result.before.episodes == result.after.episodes == 4
    assert result.after.version == 3
    run_dir = result.run_dir
    assert json.loads((run_dir / "eval.json").read_text())["after"]["version"] == 3
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert all(m["rollout/staleness_max"] <= max_staleness for m in logged)
    # Each step's trained tokens are the generated tokens of the episodes it consumed.
    tokens = Counter()
    for episode, step in consumed:
        tokens[step + 1] += episode.num_tokens
    assert [m["rollout/trained_tokens"] for m in logged] == [tokens[s] for s in (1, 2, 3)]
    assert all(tokens[s] > 0 for s in (1, 2, 3))
    assert (run_dir / "checkpoints" / "step-3" / "trainer_state.json").is_file()


def test_a_run_with_the_trainer_in_its_own_process_pushes_its_weights(run_config):
    cfg, result = _run(run_config(train={"separate_process": True}, run={"steps": 2}))
    assert result.steps == 2 and result.version == 2
    store, consumed = _consumed(cfg)
    assert Counter(step for _, step in consumed) == {0: 4, 1: 4}
    # The engine serves the child's pushed weights: evaluation tokens carry version 2.
    evaluated = store.query(run_id="eval-trained")
    assert {v for e in evaluated for t in e.turns for v in t.versions} == {2}
    assert (result.run_dir / "checkpoints" / "step-2" / "trainer_state.json").is_file()


def test_a_second_run_in_the_same_dir_needs_resume(run_config):
    path = run_config(run={"steps": 1})
    _run(path)
    with pytest.raises(RunError, match="--resume"):
        _run(path)
    # --resume of a finished run trains nothing more and keeps every mark.
    cfg, result = _run(path, resume=True)
    assert result.reports == [] and result.steps == 1
    assert Counter(step for _, step in _consumed(cfg)[1]) == {0: 4}


def test_resume_without_a_checkpoint_is_refused(run_config):
    with pytest.raises(RunError, match="no run to resume"):
        _run(run_config(), resume=True)


def test_a_run_that_stopped_before_its_first_checkpoint_resumes_from_the_start(run_config):
    path = run_config(run={"steps": 2})
    _, first = _run(path, "run.steps=0", "eval.after=false")  # evaluated, never trained
    assert first.steps == 0 and first.before is not None
    with pytest.raises(RunError, match="--resume"):
        _run(path)
    cfg, result = _run(path, resume=True)
    assert result.resumed_from == 0 and result.steps == 2
    assert Counter(step for _, step in _consumed(cfg)[1]) == {0: 4, 1: 4}


def test_the_engine_dying_mid_run_is_restarted_with_the_latest_weights(run_config):
    """The embedded engine's scheduler loop breaks after step 1; the run rebuilds the engine,
    loads the trained weights into it, and finishes every step."""
    cfg = load_config(run_config(run={"steps": 4}, eval={"before": False, "after": False}))
    events: list[str] = []

    def crash_once(report):
        if report.step != 1:
            return
        engine = run.stack.engine.engine  # the SupervisedEngine's current embedded engine

        def broken_step():
            raise SystemExit("simulated engine crash")

        engine._step = broken_step

    run = TrainingRun(cfg, config_dir=cfg_dir(cfg), on_step=crash_once, on_event=events.append)
    result = asyncio.run(run.run())
    assert result.steps == 4
    assert any("the engine died" in e for e in events), events
    restarted = [e for e in events if "serves again at weight version" in e]
    assert restarted and int(restarted[0].rsplit(" ", 1)[-1]) >= 1  # trained weights, not v0
    store = TrajectoryStore(cfg.run.dir)
    failed = [e for e in store.query(run_id="train") if e.status.value == "failed"]
    late = {v for e in store.query(run_id="train") for t in e.turns for v in t.versions}
    assert max(late) >= 2  # the rebuilt engine kept receiving pushes (staleness 1, 4 steps)
    assert len(failed) < len(store.query(run_id="train"))


def cfg_dir(cfg):
    from pathlib import Path

    return Path(cfg.data.path).parent


def test_dynamic_filtering_trains_only_groups_whose_rewards_differ(run_config):
    cfg, result = _run(
        run_config(algorithm={"dynamic_filter": True}, eval={"before": False, "after": False})
    )
    assert result.steps == 3
    _, consumed = _consumed(cfg)
    groups: dict[str, set[float]] = {}
    for episode, _step in consumed:
        groups.setdefault(episode.group_id, set()).add(episode.reward)
    assert len(groups) == 3 * 2 and all(len(rewards) > 1 for rewards in groups.values())
    logged = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    dropped = sum(m["rollout/dropped_flat_groups"] for m in logged)
    # A dropped group stays in the store, whole, flat and untrained.
    untrained: dict[str, list[float]] = {}
    for e in TrajectoryStore(cfg.run.dir).query(run_id="train", consumed=False):
        untrained.setdefault(e.group_id, []).append(e.reward)
    flat = [g for g, rewards in untrained.items() if len(rewards) == 2 and len(set(rewards)) == 1]
    assert dropped <= len(flat)


def test_a_resumed_run_completes_a_group_the_crash_cut_short(run_config, caplog):
    """A group with one of its two samples stored (the process died while the other ran) is
    completed on its task under the same group id before it trains, never trained as a group
    of one; a partial group whose task left the data is not trained."""
    path = run_config(run={"steps": 2}, eval={"after": False})
    _run(path, "run.steps=0")  # stores the initial policy's held-out episodes only
    cfg = load_config(path)
    store = TrajectoryStore(cfg.run.dir, run_id="train")
    sampled = store.query(run_id="eval-initial")[0]  # real turns of the task's prompt

    def cut_short(task_id, group_id):
        metadata = {"start_version": 0, "sample": 1, "attempt": 0}
        episode = Episode(
            task_id=task_id,
            group_id=group_id,
            reward=sampled.reward,
            metadata=metadata,
            turns=sampled.turns,
        )
        store.append(episode)
        return episode

    kept = cut_short(sampled.task_id, "grp-cut")
    orphan = cut_short("no-such-task", "grp-orphan")
    events: list[str] = []
    run = TrainingRun(cfg, config_dir=path.parent, resume=True, on_event=events.append)
    result = asyncio.run(run.run())
    assert result.steps == 2 and result.refed_episodes == 2
    assert any("(2 partial groups to complete)" in e for e in events), events
    assert "no longer has" in caplog.text and "grp-orphan" in caplog.text

    _, consumed = _consumed(cfg)
    assert Counter(step for _, step in consumed) == {0: 4, 1: 4}
    group = sorted(store.query(group_id="grp-cut"), key=lambda e: e.metadata["sample"])
    assert [e.metadata["sample"] for e in group] == [0, 1] and group[1].id == kept.id
    assert group[0].task_id == sampled.task_id and group[0].metadata["start_version"] == 0
    assert group[0].status == EpisodeStatus.OK and group[0].turns
    steps = {e.id: s for e, s in consumed}
    assert group[0].id in steps and steps[group[0].id] == steps[kept.id]
    # Every trained group is whole: two samples, trained by one step.
    by_group: dict[str, list[tuple[int, int]]] = {}
    for e, s in consumed:
        by_group.setdefault(e.group_id, []).append((e.metadata["sample"], s))
    assert all(
        sorted(i for i, _ in v) == [0, 1] and len({s for _, s in v}) == 1 for v in by_group.values()
    )
    assert store.query(group_id="grp-orphan") == [orphan] and orphan.id not in steps


def test_an_evaluation_cut_short_runs_again_without_its_partial_episodes(run_config):
    """The process died while evaluating the initial policy: two of its four held-out
    episodes were stored, no result. The resumed run evaluates all four again and counts
    only those."""
    path = run_config(run={"steps": 1}, eval={"after": False})
    cfg = load_config(path)
    with TrajectoryStore(cfg.run.dir) as store:
        for _ in range(2):
            store.append(Episode(task_id="t0", reward=1.0), run_id="eval-initial")
    _, result = _run(path, resume=True)
    assert result.before is not None and result.before.episodes == 4
    with TrajectoryStore(cfg.run.dir) as store:
        assert store.count(run_id="eval-initial") == 4
        assert store.count(run_id="eval-initial-partial") == 2
    assert json.loads((result.run_dir / "eval.json").read_text())["before"]["episodes"] == 4


SLOW_FIRST_TASK = """
import asyncio

import areal_sdk as areal
from openai import AsyncOpenAI

SLOW = set()


@areal.trace
async def solve(task):
    SLOW.add(next(iter(SLOW), task["id"]))  # the first task seen
    reply = await AsyncOpenAI().chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=6,
    )
    if task["id"] in SLOW:  # a long tail: this group can never finish in time
        await asyncio.sleep(600)
    return float(len(reply.choices[0].message.content or "") % 3 == 0)
"""


def test_a_group_that_can_no_longer_be_trained_is_stopped_mid_run(run_config):
    path = run_config(
        run={"steps": 4}, rollout={"max_staleness": 1}, eval={"before": False, "after": False}
    )
    (path.parent / "toy_agent.py").write_text(SLOW_FIRST_TASK)
    cfg, result = _run(path)
    assert result.steps == 4
    store = TrajectoryStore(cfg.run.dir)
    failed = [e for e in store.query(run_id="train") if e.status != EpisodeStatus.OK]
    assert failed, "the slow group was never stopped"
    slow = [e for e in store.query(run_id="train") if e.task_id == failed[0].task_id]
    # Started at step 0, the group cannot train from step 2 on (2 - 0 > 1): its agents were
    # cancelled then and their episodes stored with the reason, not left to run out the run
    # (episodes cancelled at the end of a run are never stored).
    assert len(slow) == 2
    assert all(e.status == EpisodeStatus.FAILED and e.error == STOPPED_STALE for e in slow)
    assert all(e.metadata["attempt"] == 0 for e in slow)  # a stopped episode is not retried
    assert not any(e.task_id == slow[0].task_id for e, _ in _consumed(cfg)[1])
    logged = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["rollout/stopped_stale"] == 2
    # Steps 1 and 2 start while the slow group's two agents sleep.
    assert all(m["rollout/running"] >= 2 for m in logged[:2])
    assert all(m["rollout/admission_room"] >= 0 for m in logged)
