"""The CAMEL adapter: real ModelFactory backends and ChatAgent against recorder servers.

camel-ai caps pydantic below what openai-agents needs, so it lives in its own environment
(docs/extras.md). Run these with:
    /work/venv-camel/bin/python -m pytest tests/plugins/test_camel.py -q
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

import areal_sdk as areal
from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.plugin_host import PluginHost
from areal_sdk.tracing import rollout_scope
from tests.plugins.conftest import Blocked

pytest.importorskip(
    "camel", reason="camel-ai not installed: pip install 'areal-sdk[camel]' (own env)"
)

from camel.agents import ChatAgent
from camel.messages import BaseMessage
from camel.models import ModelFactory
from camel.toolkits import FunctionTool
from camel.types import ModelPlatformType, ModelType


def add(a: int, b: int) -> int:
    r"""Add two integers.

    Args:
        a (int): The first number.
        b (int): The second number.

    Returns:
        int: The sum.
    """
    return a + b


class WordCounter:
    """For backends that are not routed: tiktoken would download its encoding (offline here)."""

    def count_tokens_from_messages(self, messages):
        return sum(len(str(m.get("content", "")).split()) for m in messages)

    def encode(self, text):
        return list(range(len(text.split())))

    def decode(self, token_ids):
        return " ".join("w" for _ in token_ids)


def _openai_backend(**kwargs):
    return ModelFactory.create(
        model_platform=ModelPlatformType.OPENAI, model_type=ModelType.GPT_4O_MINI, **kwargs
    )


def test_openai_platform_default_routes_with_role_metadata(host, scope, gateway):
    @areal.trace
    def agent(task):
        system = BaseMessage.make_assistant_message(
            role_name="Calculator", content="You are a calculator."
        )
        bot = ChatAgent(system_message=system, model=_openai_backend(), tools=[FunctionTool(add)])
        return bot.step("what is 2 + 2?").msgs[0].content

    with rollout_scope(scope):
        assert agent({}) == "[gateway] what is 2 + 2?"
    first, second = gateway.requests  # the tool call, then the answer
    key = f"key-{scope.episodes[0].id}"
    assert [(r.path, r.bearer) for r in gateway.requests] == [("/v1/chat/completions", key)] * 2
    meta = first.metadata["camel"]
    assert meta["role_name"] == "Calculator" and meta["role_type"] == "assistant"
    assert meta["model_type"].startswith("gpt-4o-mini")
    assert second.body["messages"][-1]["role"] == "tool"
    assert second.body["messages"][-1]["content"] == "4"


def test_chat_agent_with_the_default_model_routes(host, scope, gateway):
    @areal.trace
    def agent(task):
        return ChatAgent("Be brief.").step("hi").msgs[0].content

    with rollout_scope(scope):
        assert agent({}) == "[gateway] hi"
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"


def test_openai_compatible_platform_at_the_gateway_and_elsewhere(host, scope, gateway, other):
    @areal.trace
    def agent(task):
        policy = ModelFactory.create(
            model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL,
            model_type="policy",
            url=gateway.url + "/v1",
        )
        judge = ModelFactory.create(
            model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL,
            model_type="judge",
            url=other.url + "/v1",
            api_key="judge-key",
            token_counter=WordCounter(),
        )
        return [
            ChatAgent("p", model=policy).step("policy").msgs[0].content,
            ChatAgent("j", model=judge).step("judge").msgs[0].content,
        ]

    with rollout_scope(scope):
        assert agent({}) == ["[gateway] policy", "[other] judge"]
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"
    assert other.requests[0].bearer == "judge-key"
    assert "x-areal-metadata" not in other.requests[0].headers


def test_compatible_platform_env_names(host, scope, gateway, other, monkeypatch):
    monkeypatch.setenv("OPENAI_COMPATIBILITY_API_BASE_URL", other.url + "/v1")
    monkeypatch.setenv("OPENAI_COMPATIBILITY_API_KEY", "env-key")

    @areal.trace
    def agent(task):
        backend = ModelFactory.create(
            model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL,
            model_type="served",
            token_counter=WordCounter(),
        )
        return ChatAgent("x", model=backend).step("env").msgs[0].content

    with rollout_scope(scope):  # an address from the environment is the user's default
        assert agent({}) == "[gateway] env"
    assert other.requests == []
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"


def test_outside_an_episode_nothing_changes(host, gateway, request_log, monkeypatch):
    import openai

    monkeypatch.setenv("OPENAI_API_KEY", "user-key")
    client = openai.OpenAI(
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [request_log]}), max_retries=0
    )
    backend = _openai_backend(token_counter=WordCounter(), client=client)
    with pytest.raises((Blocked, openai.APIConnectionError)):
        backend.run([{"role": "user", "content": "no episode"}])
    assert request_log.urls == ["https://api.openai.com/v1/chat/completions"]
    assert gateway.requests == []


async def test_eight_concurrent_async_episodes_without_cross_talk(host, scope, gateway):
    @areal.trace
    async def agent(task):
        bot = ChatAgent("Be brief.", model=_openai_backend())
        reply = await bot.astep(task["id"])
        return 1.0 if reply.msgs[0].content.endswith(task["id"]) else 0.0

    with rollout_scope(scope):
        assert await asyncio.gather(*(agent({"id": f"t{i}"}) for i in range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway)


def test_eight_threaded_episodes_without_cross_talk(host, scope, gateway):
    @areal.trace
    def agent(task):
        ChatAgent("Be brief.", model=_openai_backend()).step(task["id"])
        return 1.0

    def run(i):
        with rollout_scope(scope):
            return agent({"id": f"t{i}"})

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway)


def _assert_no_cross_talk(scope, gateway) -> None:
    key_of_task = {ep.task_id: f"key-{ep.id}" for ep in scope.episodes}
    assert len(key_of_task) == 8 and len(gateway.requests) == 8
    agent_ids = set()
    for req in gateway.requests:
        assert req.bearer == key_of_task[req.body["messages"][-1]["content"]]
        agent_ids.add(req.metadata["camel"]["agent_id"])
    assert len(agent_ids) == 8


def test_remove_routing_restores_camel(gateway):
    create, step = ModelFactory.__dict__["create"], ChatAgent.step
    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    host.install_routing(GatewayRoute(gateway.url))
    assert ChatAgent.step is not step
    host.remove_routing()
    assert ModelFactory.__dict__["create"] is create and ChatAgent.step is step
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        _openai_backend()  # CAMEL's own key check is back
