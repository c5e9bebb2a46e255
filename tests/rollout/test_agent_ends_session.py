"""An agent that ends its own session (``POST /rl/sessions/{id}/end``, as documented for
hand-run agents) under ``areal-sdk rollout`` and ``areal-sdk train``: the run completes and
the outcome the agent stored stands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_sdk.store import TrajectoryStore
from tests.training.conftest import write_run

AGENT = """
import httpx
import areal_sdk as areal
from openai import AsyncOpenAI


@areal.trace
async def solve(task):
    client = AsyncOpenAI()
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=6,
    )
    reward = float(len(reply.choices[0].message.content or "") % 3 == 0)
    episode = areal.current_episode()
    async with httpx.AsyncClient() as http:
        for _ in range(2):  # ending twice is harmless
            r = await http.post(
                f"{episode.base_url}/rl/sessions/{episode.id}/end",
                json={"reward": reward},
                headers={"Authorization": f"Bearer {episode.api_key}"},
            )
            r.raise_for_status()
    return reward
"""


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_sdk", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,  # a stalled run fails here rather than hanging
    )


@pytest.fixture
def config(tmp_path, tiny_model_dir):
    path = write_run(
        tmp_path,
        tiny_model_dir,
        rollout={"group_size": 2, "batch_size": 2, "concurrency": 4},
        run={"steps": 1},
        eval={"before": False, "after": False},
    )
    (tmp_path / "toy_agent.py").write_text(AGENT)
    return path


@pytest.mark.slow
def test_rollout_completes_when_the_agent_ends_its_own_session(config):
    done = cli("rollout", config, "data.limit=2")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    assert "4 episodes (0 failed)" in done.stdout
    with TrajectoryStore(config.parent / "run") as store:
        episodes = store.query(run_id="rollout")
    assert len(episodes) == 4
    assert all(e.status == "ok" and len(e.turns) == 1 for e in episodes)
    assert all(e.reward in (0.0, 1.0) for e in episodes)


@pytest.mark.slow
def test_training_completes_when_the_agent_ends_its_own_session(config):
    done = cli("train", config)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "step 1/1" in done.stdout
    with TrajectoryStore(config.parent / "run") as store:
        trained = store.consumed_steps()
        assert sorted(trained.values()) == [0, 0]
        assert all(store.get(i).turns for i in trained)


def test_an_episode_that_cannot_be_ended_fails_alone_and_its_group_finishes(tmp_path):
    import asyncio

    import areal_sdk as areal
    from areal_sdk.rollout import RolloutController, StoreSessions

    class FlakySessions(StoreSessions):
        async def end(self, ctx):
            if ctx.episode.metadata["sample"] == 1:
                raise ConnectionError("gateway went away")
            return await super().end(ctx)

    @areal.trace
    def agent(task):
        return 1.0

    controller = RolloutController(agent, FlakySessions(TrajectoryStore(tmp_path)), group_size=3)
    group = asyncio.run(controller.run_group({"id": "t"}))
    assert [e.status for e in group] == ["ok", "failed", "ok"]
    assert "gateway went away" in group[1].error
