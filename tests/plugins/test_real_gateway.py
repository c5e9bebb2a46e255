"""Each installed framework through the real stack: embedded engine (tiny model), gateway,
rollout controller and store, all on loopback. Every call must land as a token-exact turn
in its own episode; a judge on another server must not."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

import areal_sdk as areal
from areal_sdk.plugin_host import PluginHost

launcher = pytest.importorskip("areal_sdk.launcher", reason="the local launcher is not built yet")
from areal_sdk.config import load_config  # noqa: E402
from areal_sdk.rollout import RolloutController  # noqa: E402
from areal_sdk.store import TrajectoryStore  # noqa: E402


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", "inference.max_new_tokens=6", "inference.device=cpu"]
    )
    store = TrajectoryStore(tmp_path_factory.mktemp("store"))
    host = PluginHost()
    # The engine's and the gateway's plugins, until their entry points are declared.
    if "embedded" not in host.inference_backends():
        from areal_sdk.backends.embedded import plugin as engine_plugin

        host.register(engine_plugin, "embedded")
    if "hermes" not in host.tool_call_parsers():
        from areal_sdk.gateway import plugin as gateway_plugin

        host.register(gateway_plugin, "gateway")
    with launcher.LocalStack(cfg, store, host=host) as running:
        yield running


def _needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} not installed"
    )


def _run(stack, agent, n: int = 8, run_id: str = "t"):
    sessions = stack.sessions(run_id)
    controller = RolloutController(agent, sessions, concurrency=8, timeout_s=120)
    tasks = [{"id": f"{run_id}-{i}", "question": f"What is {i} + 1?"} for i in range(n)]

    summary = asyncio.run(controller.run(tasks))
    errors = [e.error for e in summary.episodes if e.error]
    assert not errors, errors
    return summary


def _assert_turns(summary, api: str, per_episode: int = 1) -> None:
    assert len(summary.episodes) == 8
    for episode in summary.episodes:
        assert len(episode.turns) == per_episode, episode.id
        for turn in episode.turns:
            assert turn.api == api
            assert turn.prompt_ids and turn.completion_ids
            assert len(turn.logprobs) == len(turn.completion_ids) == len(turn.versions)
            # the turn's request is this episode's own question: no cross-talk
            assert episode.task_id.split("-")[-1] + " + 1" in str(turn.request)


@_needs("openai")
def test_openai_sdk_through_the_real_gateway(stack, other_server):
    import openai

    judge = openai.AsyncOpenAI(base_url=other_server.url + "/v1", api_key="judge")

    @areal.trace
    async def agent(task):
        client = openai.AsyncOpenAI()
        reply = await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": task["question"]}], max_tokens=6
        )
        await judge.chat.completions.create(
            model="judge", messages=[{"role": "user", "content": "score"}]
        )
        return float(len(reply.choices[0].message.content or "") >= 0)

    summary = _run(stack, agent, run_id="openai")
    _assert_turns(summary, "openai.chat")
    assert len(other_server.requests) == 8  # the judge calls went to the judge only


@_needs("anthropic")
def test_anthropic_sdk_through_the_real_gateway(stack):
    import anthropic

    @areal.trace
    def agent(task):
        reply = anthropic.Anthropic().messages.create(
            model="claude-sonnet-4-5",
            max_tokens=6,
            messages=[{"role": "user", "content": task["question"]}],
        )
        return 1.0 if reply.stop_reason in ("end_turn", "max_tokens", "stop_sequence") else 0.0

    _assert_turns(_run(stack, agent, run_id="anthropic"), "anthropic.messages")


@_needs("langchain_openai")
def test_langchain_through_the_real_gateway(stack):
    from langchain_openai import ChatOpenAI

    @areal.trace
    async def agent(task):
        # langchain-openai caches one default async HTTP client per process; the adapter
        # gives each event loop its own (each test here runs on a loop of its own).
        model = ChatOpenAI(model="gpt-4o-mini", max_tokens=6)
        reply = await model.ainvoke(task["question"])
        return 1.0 if isinstance(reply.content, str) else 0.0

    summary = _run(stack, agent, run_id="langchain")
    _assert_turns(summary, "openai.chat")
    # The callback's structure reaches the stored turn through the gateway, per episode.
    run_ids = {e.turns[0].metadata["langchain"]["run_id"] for e in summary.episodes}
    assert len(run_ids) == 8


@_needs("agents")
def test_openai_agents_through_the_real_gateway(stack):
    from agents import Agent, ModelSettings, Runner
    from agents.exceptions import ModelBehaviorError

    # Greedy: what a random tiny model writes must not decide whether the test passes.
    helper = Agent(
        name="Helper",
        instructions="Answer briefly.",
        model_settings=ModelSettings(max_tokens=6, temperature=0.0),
    )

    @areal.trace
    async def agent(task):
        try:
            result = await Runner.run(helper, task["question"], max_turns=2)
        except ModelBehaviorError:  # a random tiny model stops at max_tokens: "incomplete"
            return 0.0
        return 1.0 if isinstance(result.final_output, str) else 0.0

    summary = _run(stack, agent, run_id="agents")
    _assert_turns(summary, "openai.responses")
    for episode in summary.episodes:
        assert "Helper" in str(episode.turns[0].metadata["openai_agents"])


@_needs("camel")
def test_camel_through_the_real_gateway(stack):
    from camel.agents import ChatAgent
    from camel.models import ModelFactory
    from camel.types import ModelPlatformType, ModelType

    @areal.trace
    def agent(task):
        model = ModelFactory.create(
            model_platform=ModelPlatformType.OPENAI,
            model_type=ModelType.GPT_4O_MINI,
            model_config_dict={"max_tokens": 6},
        )
        reply = ChatAgent("Answer briefly.", model=model).step(task["question"])
        return 1.0 if reply.msgs else 0.0

    _assert_turns(_run(stack, agent, run_id="camel"), "openai.chat")
