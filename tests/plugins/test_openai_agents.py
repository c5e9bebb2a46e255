"""The OpenAI Agents SDK adapter: real Agent / Runner / model providers against recorders."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

import areal_sdk as areal
from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.plugin_host import PluginHost
from areal_sdk.tracing import rollout_scope

agents = pytest.importorskip(
    "agents", reason="openai-agents not installed: pip install 'areal-sdk[openai-agents]'"
)
openai = pytest.importorskip("openai")

from agents import (  # noqa: E402
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
)

# The SDK's default provider shares one HTTP client per process, bound to the event loop
# it first ran on: one loop for the module, as in an application.
one_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", autouse=True)
def _fresh_shared_client():
    """Other modules ran the SDK under asyncio.run loops that are closed by now."""
    from agents.models import openai_provider

    openai_provider._http_client = None


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _calculator() -> Agent:
    return Agent(
        name="Calculator", instructions="Use the add tool.", model="gpt-4o-mini", tools=[add]
    )


@one_loop
async def test_default_provider_uses_responses_at_the_gateway_with_agent_metadata(
    host, scope, gateway
):
    calculator = _calculator()

    @areal.trace
    async def agent(task):
        result = await Runner.run(calculator, "what is 2 + 2?", max_turns=4)
        return str(result.final_output)

    with rollout_scope(scope):
        assert await agent({}) == "[gateway] what is 2 + 2?"
    first, second = gateway.requests
    key = f"key-{scope.episodes[0].id}"
    assert [(r.path, r.bearer) for r in gateway.requests] == [("/v1/responses", key)] * 2
    meta = first.metadata["openai_agents"]
    assert meta["agent"] == "Calculator"
    assert meta["workflow_name"] == "Agent workflow"
    assert meta["spans"] == ["task:Agent workflow", "agent:Calculator", "turn", "response"]
    assert second.metadata["openai_agents"]["tools_since_last_call"] == ["add"]
    assert second.metadata["openai_agents"]["trace_id"] == meta["trace_id"]
    assert any(
        item.get("type") == "function_call_output" and item["output"] == "4"
        for item in second.body["input"]
    )


@one_loop
async def test_chat_completions_model_on_a_default_client_routes(host, scope, gateway):
    @areal.trace
    async def agent(task):
        model = OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=openai.AsyncOpenAI())
        helper = Agent(name="Helper", instructions="Be brief.", model=model)
        return str((await Runner.run(helper, "hi")).final_output)

    with rollout_scope(scope):
        assert await agent({}) == "[gateway] hi"
    (req,) = gateway.requests
    assert req.path == "/v1/chat/completions"
    assert req.bearer == f"key-{scope.episodes[0].id}"
    assert req.metadata["openai_agents"]["agent"] == "Helper"


@one_loop
async def test_provider_pointed_elsewhere_is_untouched(host, scope, gateway, other):
    judge_provider = OpenAIProvider(
        base_url=other.url + "/v1", api_key="judge-key", use_responses=False
    )

    @areal.trace
    async def agent(task):
        policy = await Runner.run(Agent(name="Policy", instructions="x"), "policy")
        judge = await Runner.run(
            Agent(name="Judge", instructions="x"),
            "judge",
            run_config=RunConfig(model_provider=judge_provider),
        )
        return [str(policy.final_output), str(judge.final_output)]

    with rollout_scope(scope):
        assert await agent({}) == ["[gateway] policy", "[other] judge"]
    assert len(gateway.requests) == 1
    (judged,) = other.requests
    assert judged.path == "/v1/chat/completions"
    assert judged.bearer == "judge-key" and "x-areal-metadata" not in judged.headers


@one_loop
async def test_eight_concurrent_async_episodes_without_cross_talk(host, scope, gateway):
    helper = Agent(name="Helper", instructions="Be brief.")

    @areal.trace
    async def agent(task):
        result = await Runner.run(helper, task["id"])
        return 1.0 if str(result.final_output).endswith(task["id"]) else 0.0

    with rollout_scope(scope):
        assert await asyncio.gather(*(agent({"id": f"t{i}"}) for i in range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway)


def test_eight_threaded_episodes_without_cross_talk(host, scope, gateway):
    @areal.trace
    def agent(task):
        # run_sync starts an event loop per thread; each gets its own client (the default
        # provider's shared HTTP client belongs to one loop).
        model = OpenAIChatCompletionsModel(model="m", openai_client=openai.AsyncOpenAI())
        Runner.run_sync(Agent(name="Helper", instructions="Be brief.", model=model), task["id"])
        return 1.0

    def run(i):
        with rollout_scope(scope):
            return agent({"id": f"t{i}"})

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway)


def test_the_default_provider_runs_on_any_event_loop(host, scope, gateway):
    """Episodes on different event loops (one ``asyncio.run`` per call, ``Runner.run_sync``
    in threads) share the SDK's default provider, whose HTTP client is one per process: each
    loop must get connections of its own, or a call picks up a kept-alive connection of a
    closed loop ("Event loop is closed")."""
    helper = Agent(name="Helper", instructions="Be brief.")

    @areal.trace
    async def agent(task):
        result = await Runner.run(helper, task["id"])
        return 1.0 if str(result.final_output).endswith(task["id"]) else 0.0

    @areal.trace
    def sync_agent(task):
        result = Runner.run_sync(helper, task["id"])
        return 1.0 if str(result.final_output).endswith(task["id"]) else 0.0

    def run(i):
        with rollout_scope(scope):
            return sync_agent({"id": f"t{i}"})

    with rollout_scope(scope):
        assert [asyncio.run(agent({"id": f"t{i}"})) for i in range(4)] == [1.0] * 4
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4, 8))) == [1.0] * 4
    _assert_no_cross_talk(scope, gateway)


def _assert_no_cross_talk(scope, gateway) -> None:
    key_of_task = {ep.task_id: f"key-{ep.id}" for ep in scope.episodes}
    assert len(key_of_task) == 8 and len(gateway.requests) == 8
    traces = set()
    for req in gateway.requests:
        body = req.body.get("input") or req.body["messages"]
        text = body[-1]["content"]
        assert req.bearer == key_of_task[text]
        traces.add(req.metadata["openai_agents"]["trace_id"])
    assert len(traces) == 8


@one_loop
async def test_outside_an_episode_nothing_changes(host, gateway, request_log):
    client = openai.AsyncOpenAI(
        api_key="user-key",
        http_client=openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [request_log.async_hook]}
        ),
        max_retries=0,
    )
    model = OpenAIChatCompletionsModel(model="m", openai_client=client)
    with pytest.raises(Exception):  # noqa: B017  the request was stopped before leaving
        await Runner.run(Agent(name="Offline", instructions="x", model=model), "no episode")
    assert request_log.urls == ["https://api.openai.com/v1/chat/completions"]
    assert "x-areal-metadata" not in request_log.headers[0]
    assert gateway.requests == []


def test_remove_routing_leaves_the_processor_inert(gateway):
    from areal_sdk.plugins import _routing, openai_agents

    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    host.install_routing(GatewayRoute(gateway.url))  # idempotent: one processor
    processor = openai_agents._processor
    assert processor is not None
    host.remove_routing()
    host.install_routing(GatewayRoute(gateway.url))
    assert openai_agents._processor is processor
    host.remove_routing()
    assert not openai_agents._book.active
    assert "openai_agents" not in _routing._metadata_providers


@one_loop
async def test_episode_traces_are_not_exported(host, scope, gateway, caplog):
    """The SDK's default exporter would send an episode's trace to OpenAI, or without a key
    print "OPENAI_API_KEY is not set, skipping trace export" for every batch."""
    from agents.tracing import flush_traces

    helper = Agent(name="Helper", instructions="Be brief.")

    @areal.trace
    async def agent(task):
        return str((await Runner.run(helper, "hi")).final_output)

    flush_traces()  # what other tests left queued, traces outside episodes among them
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="openai.agents"):
        with rollout_scope(scope):
            assert await agent({}) == "[gateway] hi"
        flush_traces()
    assert "skipping trace export" not in caplog.text
