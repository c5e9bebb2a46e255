"""The launcher's in-process sessions on a real stack (tiny engine, gateway, store): an
episode's turns and reward come back as stored, a store that fails once is retried, and an
episode whose session the gateway does not know keeps its outcome."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from areal_sdk.config import load_config
from areal_sdk.launcher import LocalStack
from areal_sdk.plugin_host import PluginHost
from areal_sdk.store import TrajectoryStore
from areal_sdk.tracing import EpisodeContext
from areal_sdk.trajectory import Episode, EpisodeStatus


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", "inference.max_new_tokens=4", "inference.device=cpu"]
    )
    store = TrajectoryStore(tmp_path_factory.mktemp("store"))
    host = PluginHost()
    if "embedded" not in host.inference_backends():
        from areal_sdk.backends.embedded import plugin as engine_plugin

        host.register(engine_plugin, "embedded")
    with LocalStack(cfg, store, host=host) as running:
        yield running


async def _one_call(stack: LocalStack, sessions, episode: Episode) -> EpisodeContext:
    key = await sessions.open(episode)
    client = AsyncOpenAI(base_url=stack.url + "/v1", api_key=key)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    await client.close()
    ctx = EpisodeContext(episode=episode, name="agent", base_url=stack.url, api_key=key)
    episode.reward = 0.5
    return ctx


def test_an_ended_episode_is_read_back_as_stored(stack: LocalStack) -> None:
    sessions = stack.sessions("t")

    async def go() -> Episode:
        ctx = await _one_call(stack, sessions, Episode(task_id="a"))
        return await sessions.end(ctx)

    episode = asyncio.run(go())
    assert episode.status == EpisodeStatus.OK and episode.reward == 0.5
    assert len(episode.turns) == 1 and episode.turns[0].completion_ids
    assert stack.store.get(episode.id) == episode
    assert episode.metadata["run_id"] == "t"


def test_a_store_that_fails_once_is_retried(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = stack.sessions("t")
    real_append = stack.store.append
    calls = []

    def flaky(episode: Episode, **kwargs: object) -> None:
        calls.append(episode.id)
        if len(calls) == 1:
            raise OSError("disk busy")
        real_append(episode, **kwargs)

    monkeypatch.setattr(stack.store, "append", flaky)

    async def go() -> Episode:
        ctx = await _one_call(stack, sessions, Episode(task_id="b"))
        return await sessions.end(ctx)

    episode = asyncio.run(go())
    assert len(calls) == 2  # refused once, then stored with its turn
    assert episode.status == EpisodeStatus.OK and len(episode.turns) == 1
    assert stack.store.get(episode.id).reward == 0.5


def test_an_episode_the_gateway_does_not_know_keeps_its_outcome(stack: LocalStack) -> None:
    sessions = stack.sessions("t")
    episode = Episode(task_id="c", reward=1.0)
    ctx = EpisodeContext(episode=episode, name="agent")
    ended = asyncio.run(sessions.end(ctx))
    assert ended.status == EpisodeStatus.FAILED
    assert "no open session" in (ended.error or "")
    stored = stack.store.get(episode.id)
    assert stored.reward == 1.0 and stored.status == EpisodeStatus.FAILED


def test_open_agent_imports_a_package_beside_the_config_without_shadowing(tmp_path) -> None:
    """A package agent keeps its relative and sibling imports; its directory never goes ahead
    of the installed packages on sys.path."""
    import sys

    from areal_sdk.launcher import open_agent

    (tmp_path / "openai").mkdir()  # named like the OpenAI SDK, and a namespace package
    (tmp_path / "openai" / "agent.py").write_text(
        "from .prompts import PREFIX\nfrom helpers import SUFFIX\n\n"
        "def solve(task):\n    return PREFIX + task + SUFFIX\n"
    )
    (tmp_path / "openai" / "prompts.py").write_text("PREFIX = '<'\n")
    (tmp_path / "helpers.py").write_text("SUFFIX = '>'\n")
    cfg = load_config(None, ["agent.entry=openai.agent:solve"])
    address, agent = open_agent(cfg, PluginHost(), search_path=[tmp_path])
    try:
        assert agent("x") == "<x>"  # outside a rollout the traced agent runs as written
        assert sys.path[-1] == str(tmp_path)
        import openai

        assert hasattr(openai, "OpenAI")  # still the SDK
        assert not agent.__module__.startswith("openai")
    finally:
        address.close()
