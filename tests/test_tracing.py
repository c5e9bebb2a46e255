import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import areal_sdk as areal
from areal_sdk.tracing import LocalRollout


@areal.trace
def solve(task):
    if task.get("boom"):
        raise ValueError("agent broke")
    return task["score"]


@areal.trace(name="async-solver")
async def asolve(task):
    await asyncio.sleep(0)
    return task["score"]


def test_transparent_outside_a_rollout():
    assert solve({"score": 0.5}) == 0.5
    with pytest.raises(ValueError, match="agent broke"):
        solve({"boom": True})
    assert asyncio.run(asolve({"score": 2})) == 2
    assert areal.current_episode() is None
    areal.reward(1.0)  # a no-op outside an episode


def test_float_return_is_the_reward_and_name_is_recorded():
    rollout = LocalRollout(group_id="g")
    with areal.rollout_scope(rollout):
        assert solve({"id": "t1", "score": 0.75}) == 0.75
        assert asyncio.run(asolve({"id": "t2", "score": 1})) == 1
    first, second = rollout.episodes
    assert (first.task_id, first.reward, first.status, first.group_id) == ("t1", 0.75, "ok", "g")
    assert first.metadata["agent"] == "solve"
    assert second.metadata["agent"] == "async-solver" and second.reward == 1.0
    assert first.ended is not None and first.ended >= first.started


def test_exception_inside_a_rollout_fails_the_episode_without_raising():
    rollout = LocalRollout()
    with areal.rollout_scope(rollout):
        assert solve({"boom": True}) is None
    (ep,) = rollout.episodes
    assert ep.status == "failed"
    assert ep.error == "ValueError: agent broke"
    assert "Traceback" in ep.metadata["traceback"]


def test_reward_from_inside_overrides_the_return_value():
    @areal.trace
    def agent(task):
        areal.reward(0.25)
        return None

    rollout = LocalRollout()
    with areal.rollout_scope(rollout):
        agent({})
    assert rollout.episodes[0].reward == 0.25
    bad = LocalRollout()
    with areal.rollout_scope(bad):
        areal.trace(lambda t: areal.reward("high"))({})
    assert bad.episodes[0].status == "failed"
    assert "is not a number: str 'high'" in bad.episodes[0].error


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", None, [1.0]])
def test_a_reward_that_is_no_finite_number_fails_the_episode(value):
    @areal.trace
    def gives(task):
        areal.reward(value)
        areal.reward(1.0)  # a later valid reward does not hide the bad one
        return 1.0

    @areal.trace
    def returns(task):
        return value

    rollout = LocalRollout()
    with areal.rollout_scope(rollout):
        gives({})
        returns({})
    given, returned = rollout.episodes
    assert given.status == "failed" and "areal.reward()" in given.error
    assert repr(value)[:10] in given.error
    if isinstance(value, float):  # a returned float is the reward; other values are not
        assert returned.status == "failed" and "the agent returned is not finite" in returned.error


def test_concurrent_asyncio_tasks_each_see_their_own_episode():
    seen = {}

    @areal.trace
    async def agent(task):
        ep = areal.current_episode()
        await asyncio.sleep(0.01 * (3 - task["i"]))
        inner = await asyncio.create_task(child())  # tasks inherit the context
        seen[task["i"]] = (ep.id, inner)
        return float(task["i"])

    async def child():
        return areal.current_episode().id

    async def main():
        with areal.rollout_scope(rollout):
            await asyncio.gather(*(agent({"i": i}) for i in range(3)))

    rollout = LocalRollout()
    asyncio.run(main())
    assert len({ep_id for ep_id, _ in seen.values()}) == 3
    assert all(ep_id == inner for ep_id, inner in seen.values())
    assert sorted(e.reward for e in rollout.episodes) == [0.0, 1.0, 2.0]


def test_bind_carries_the_episode_into_threads():
    results = {}

    @areal.trace
    def agent(task):
        ep_id = areal.current_episode().id
        with ThreadPoolExecutor(1) as pool:
            results["bound"] = pool.submit(areal.bind(lambda: areal.current_episode().id)).result()
            results["unbound"] = pool.submit(areal.current_episode).result()
        t = threading.Thread(
            target=areal.bind(lambda: results.setdefault("thread", areal.current_episode().id))
        )
        t.start()
        t.join()
        results["own"] = ep_id
        return 1.0

    with areal.rollout_scope(LocalRollout()):
        agent({})
    assert results["bound"] == results["own"] == results["thread"]
    assert results["unbound"] is None


def test_nested_traced_calls_stay_in_the_outer_episode():
    @areal.trace
    def inner(task):
        return 0.0

    @areal.trace
    def outer(task):
        inner(task)
        return 1.0

    rollout = LocalRollout()
    with areal.rollout_scope(rollout):
        outer({})
    assert [e.reward for e in rollout.episodes] == [1.0]


def test_episode_env_routes_subprocesses():
    ctx = areal.EpisodeContext(
        episode=areal.Episode(task_id="t"), name="a", base_url="http://127.0.0.1:9/", api_key="k"
    )
    env = ctx.env()
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "k"
