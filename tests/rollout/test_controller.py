"""The rollout controller's own logic with agents that make no model calls.

Gateway-backed rollouts (turns recorded) are tested in tests/rollout/test_gateway_rollout.py.
"""

import asyncio
import json
import math
import time

import pytest

import areal_sdk as areal
from areal_sdk.rollout import RolloutController, StoreSessions
from areal_sdk.store import TrajectoryStore
from areal_sdk.tasks import TaskError, load_agent, load_tasks


@areal.trace
def scored(task):
    if task.get("raise"):
        raise RuntimeError(f"bad task {task['id']}")
    if task.get("hang"):
        time.sleep(5)
    return float(task["score"])


@areal.trace
async def async_scored(task):
    await asyncio.sleep(0.01)
    if task.get("hang"):
        await asyncio.sleep(60)
    areal.reward(task["score"] * 2)
    return None


def run(controller, tasks):
    return asyncio.run(controller.run(tasks))


def test_group_size_concurrency_and_store(tmp_path):
    store = TrajectoryStore(tmp_path)
    tasks = [{"id": f"t{i}", "score": i / 10} for i in range(4)]
    summary = run(
        RolloutController(scored, StoreSessions(store), group_size=3, concurrency=2), tasks
    )
    assert len(summary.episodes) == 12 and len(summary.ok) == 12
    groups = {}
    for ep in store.query():
        groups.setdefault(ep.group_id, []).append(ep)
    assert len(groups) == 4 and all(len(g) == 3 for g in groups.values())
    assert all(len({e.task_id for e in g}) == 1 for g in groups.values())
    assert summary.mean_reward == pytest.approx(0.15)
    assert store.query()[0].metadata["agent"] == "scored"


def test_a_failing_or_hanging_agent_fails_only_its_episode(tmp_path):
    store = TrajectoryStore(tmp_path)
    tasks = [
        {"id": "ok", "score": 1},
        {"id": "boom", "raise": True},
        {"id": "slow", "hang": True, "score": 1},
    ]
    controller = RolloutController(async_scored, StoreSessions(store), timeout_s=0.5)
    asyncio.run(controller.run(tasks[:1] + tasks[2:]))
    sync = RolloutController(scored, StoreSessions(store), timeout_s=0.5, retries=1)
    summary = asyncio.run(sync.run(tasks[:2]))
    by_task = {}
    for ep in store.query():
        by_task.setdefault(ep.task_id, []).append(ep)
    assert by_task["ok"][0].reward == 2.0 and by_task["ok"][1].reward == 1.0
    assert by_task["slow"][0].status == "failed" and "within 0.5 s" in by_task["slow"][0].error
    # The failing task was retried once; both attempts are stored with the agent's error.
    assert [e.metadata["attempt"] for e in by_task["boom"]] == [0, 1]
    assert all(e.error == "RuntimeError: bad task boom" for e in by_task["boom"])
    assert len(summary.failed) == 2 and len(summary.ok) == 1


def test_reward_function_scores_a_string_answer(tmp_path):
    @areal.trace
    def answer(task):
        return task["guess"]

    store = TrajectoryStore(tmp_path)

    def reward(completion, task):
        return float(completion == task["answer"])

    tasks = [{"id": "a", "guess": "4", "answer": "4"}, {"id": "b", "guess": "5", "answer": "4"}]
    summary = run(RolloutController(answer, StoreSessions(store), reward_fn=reward), tasks)
    assert sorted(e.reward for e in summary.episodes) == [0.0, 1.0]


def test_text_with_no_reward_or_a_score_that_is_no_number_fails_its_episode(tmp_path):
    @areal.trace
    def answer(task):
        return task["guess"]

    def reward(completion, task):
        return {"nan": math.nan, "inf": math.inf, "str": "1.0"}[completion]

    tasks = [{"id": g, "guess": g} for g in ("nan", "inf", "str")]
    store = TrajectoryStore(tmp_path)
    scored = run(RolloutController(answer, StoreSessions(store), reward_fn=reward), tasks)
    unscored = run(RolloutController(answer, StoreSessions(store)), tasks[:1])
    errors = {e.task_id: e.error for e in scored.episodes}
    assert all(e.status == "failed" for e in scored.episodes + unscored.episodes)
    assert errors == {
        "nan": "the reward function's score is not finite: nan",
        "inf": "the reward function's score is not finite: inf",
        "str": "the reward function's score is not a number: str '1.0'",
    }
    assert "returned a str, not a reward" in unscored.episodes[0].error
    assert not any(e.status == "ok" for e in store.query())  # nothing of it trains


def test_run_group_shares_a_group_and_metadata(tmp_path):
    store = TrajectoryStore(tmp_path)
    seen = []
    controller = RolloutController(
        scored, StoreSessions(store), group_size=3, on_episode=lambda e: seen.append(e.id)
    )
    group = asyncio.run(
        controller.run_group({"id": "t", "score": 1}, metadata={"start_version": 4})
    )
    assert len(group) == 3 and len({e.group_id for e in group}) == 1
    assert all(e.metadata["start_version"] == 4 for e in group)
    assert [e.metadata["sample"] for e in group] == [0, 1, 2]
    assert sorted(seen) == sorted(e.id for e in group) == sorted(e.id for e in store.query())
    # Only some samples of an existing group: what completing a group cut short runs.
    rest = asyncio.run(
        controller.run_group({"id": "t", "score": 1}, group_id=group[0].group_id, samples=[2])
    )
    assert [(e.group_id, e.metadata["sample"]) for e in rest] == [(group[0].group_id, 2)]


def test_load_tasks_and_agent(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text(
        json.dumps({"question": "1+1", "answer": "2"})
        + "\n\n"
        + json.dumps({"id": 7, "q": 1})
        + "\n"
    )
    tasks = load_tasks(data)
    assert [t["id"] for t in tasks] == ["tasks:1", "7"]
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(TaskError, match="bad.jsonl:1: not valid JSON"):
        load_tasks(tmp_path / "bad.jsonl")
    (tmp_path / "my_agent.py").write_text("def solve(task):\n    return 1.0\n")
    fn = load_agent("my_agent:solve", search_path=tmp_path)
    assert hasattr(fn, "__areal_trace__")  # undecorated agents are traced for the user
    with pytest.raises(TaskError, match="has no attribute 'nope'"):
        load_agent("my_agent:nope", search_path=tmp_path)
    with pytest.raises(TaskError, match="cannot find agent module"):
        load_agent("no_such_module_abc:f")
