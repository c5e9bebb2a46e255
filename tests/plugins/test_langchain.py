"""The LangChain adapter: real ChatOpenAI / ChatAnthropic / LangGraph against recorder servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

import areal_sdk as areal
from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.plugin_host import PluginHost
from areal_sdk.tracing import rollout_scope
from tests.plugins.conftest import Blocked, subprocess_env

pytest.importorskip(
    "langchain_core", reason="langchain not installed: pip install 'areal-sdk[langchain]'"
)
langchain_openai = pytest.importorskip(
    "langchain_openai", reason="pip install 'areal-sdk[langchain]'"
)

from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

pytest.importorskip("langgraph", reason="pip install 'areal-sdk[langchain]'")
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402


@tool
def multiply(a: int, b: int) -> int:
    """Multiply a and b."""
    return a * b


def test_async_chat_models_on_one_event_loop_per_episode(host, scope, gateway):
    """``ChatOpenAI`` and ``ChatAnthropic`` share one cached async HTTP client per process;
    episodes on loops of their own (one ``asyncio.run`` per call) must not pick up a
    kept-alive connection of a closed loop ("Event loop is closed")."""
    langchain_anthropic = pytest.importorskip("langchain_anthropic")

    @areal.trace
    async def agent(task):
        chat = langchain_openai.ChatOpenAI(model="gpt-4o-mini")
        claude = langchain_anthropic.ChatAnthropic(model="claude-haiku-4-5")
        first = await chat.ainvoke(task["id"])
        second = await claude.ainvoke(task["id"])
        return float(first.content.endswith(task["id"]) and task["id"] in str(second.content))

    with rollout_scope(scope):
        assert [asyncio.run(agent({"id": f"t{i}"})) for i in range(4)] == [1.0] * 4
    assert len(gateway.requests) == 8


def test_default_chat_openai_goes_to_the_gateway_with_the_episode_key(host, scope, gateway):
    @areal.trace
    def agent(task):
        model = langchain_openai.ChatOpenAI(model="gpt-4o-mini")
        return model.invoke("hello").content

    with rollout_scope(scope):
        assert agent({}) == "[gateway] hello"
    (req,) = gateway.requests
    assert req.path == "/v1/chat/completions"
    assert req.bearer == f"key-{scope.episodes[0].id}"
    meta = req.metadata["langchain"]
    assert meta["name"] == "ChatOpenAI"
    assert len(meta["run_id"]) == 36


def test_chat_model_pointed_elsewhere_is_untouched(host, scope, gateway, other):
    judge = langchain_openai.ChatOpenAI(
        model="judge", base_url=other.url + "/v1", api_key="judge-key"
    )

    @areal.trace
    def agent(task):
        langchain_openai.ChatOpenAI(model="policy").invoke("policy")
        return judge.invoke("judge").content

    with rollout_scope(scope):
        assert agent({}) == "[other] judge"
    assert [r.body["model"] for r in gateway.requests] == ["policy"]
    (judged,) = other.requests
    assert judged.bearer == "judge-key" and "x-areal-metadata" not in judged.headers


def test_chat_anthropic_default_and_elsewhere(host, scope, gateway, other):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")

    @areal.trace
    def agent(task):
        policy = langchain_anthropic.ChatAnthropic(model="claude-sonnet-4-5", max_tokens=32)
        judge = langchain_anthropic.ChatAnthropic(
            model="claude-judge", max_tokens=32, base_url=other.url, api_key="judge-key"
        )
        return [policy.invoke("policy").content, judge.invoke("judge").content]

    with rollout_scope(scope):
        assert agent({}) == ["[gateway] policy", "[other] judge"]
    (req,) = gateway.requests
    assert req.path == "/v1/messages"
    assert req.headers["x-api-key"] == f"key-{scope.episodes[0].id}"
    assert req.metadata["langchain"]["name"] == "ChatAnthropic"
    assert other.requests[0].api_key == "judge-key"


def _calculator_graph(model):
    bound = model.bind_tools([multiply])

    def llm_call(state: MessagesState):
        return {"messages": [bound.invoke(state["messages"])]}

    def tool_node(state: MessagesState):
        out = []
        for call in state["messages"][-1].tool_calls:
            out.append(
                ToolMessage(content=str(multiply.invoke(call["args"])), tool_call_id=call["id"])
            )
        return {"messages": out}

    def should_continue(state: MessagesState):
        return "tool_node" if state["messages"][-1].tool_calls else END

    builder = StateGraph(MessagesState)
    builder.add_node("llm_call", llm_call)
    builder.add_node("tool_node", tool_node)
    builder.add_edge(START, "llm_call")
    builder.add_conditional_edges("llm_call", should_continue, ["tool_node", END])
    builder.add_edge("tool_node", "llm_call")
    return builder.compile()


def test_langgraph_tool_loop_records_nodes_and_tools(host, scope, gateway):
    graph = _calculator_graph(langchain_openai.ChatOpenAI(model="gpt-4o-mini"))

    @areal.trace
    def agent(task):
        state = graph.invoke({"messages": [HumanMessage(content="what is 2 * 2?")]})
        return state["messages"][-1].content

    with rollout_scope(scope):
        assert agent({}) == "[gateway] what is 2 * 2?"
    first, second = gateway.requests
    key = f"key-{scope.episodes[0].id}"
    assert first.bearer == key and second.bearer == key
    assert first.metadata["langchain"]["langgraph_node"] == "llm_call"
    assert first.metadata["langchain"]["tools_bound"] == ["multiply"]
    assert "tools_since_last_call" not in first.metadata["langchain"]
    assert second.metadata["langchain"]["tools_since_last_call"] == ["multiply"]
    assert second.body["messages"][-1]["role"] == "tool"
    assert second.body["messages"][-1]["content"] == "4"


def test_outside_an_episode_nothing_changes(host, gateway, request_log, monkeypatch):
    import openai

    monkeypatch.setenv("OPENAI_API_KEY", "user-key")
    model = langchain_openai.ChatOpenAI(
        model="m",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [request_log]}),
    )
    with pytest.raises((Blocked, openai.APIConnectionError)):
        model.invoke("no episode")
    assert request_log.urls == ["https://api.openai.com/v1/chat/completions"]
    assert "x-areal-metadata" not in request_log.headers[0]
    assert gateway.requests == []


async def test_eight_concurrent_async_episodes_without_cross_talk(host, scope, gateway):
    model = langchain_openai.ChatOpenAI(model="m")  # one model shared by every episode

    @areal.trace
    async def agent(task):
        for turn in range(2):
            await model.ainvoke(f"{task['id']}/{turn}")
        return 1.0

    with rollout_scope(scope):
        assert await asyncio.gather(*(agent({"id": f"t{i}"}) for i in range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway, calls=16)


def test_eight_threaded_episodes_without_cross_talk(host, scope, gateway):
    model = langchain_openai.ChatOpenAI(model="m")

    @areal.trace
    def agent(task):
        model.invoke(task["id"] + "/0")
        return 1.0

    def run(i):
        with rollout_scope(scope):
            return agent({"id": f"t{i}"})

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway, calls=8)


def _assert_no_cross_talk(scope, gateway, *, calls: int) -> None:
    key_of_task = {ep.task_id: f"key-{ep.id}" for ep in scope.episodes}
    assert len(key_of_task) == 8 and len(gateway.requests) == calls
    run_ids = set()
    for req in gateway.requests:
        assert req.bearer == key_of_task[req.body["messages"][-1]["content"].split("/")[0]]
        run_ids.add(req.metadata["langchain"]["run_id"])
    assert len(run_ids) == calls  # each call's metadata is its own run


SUBPROCESS_AGENT = textwrap.dedent(
    """
    from langchain_openai import ChatOpenAI
    print(ChatOpenAI(model="m").invoke("from a subprocess").content)
    """
)


def test_a_subprocess_agent_gets_the_episode_through_env(scope, gateway):
    @areal.trace
    def agent(task):
        out = subprocess.run(
            [sys.executable, "-c", SUBPROCESS_AGENT],
            env=subprocess_env(areal.current_episode()),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return out.stdout.strip()

    with rollout_scope(scope):
        assert agent({}) == "[gateway] from a subprocess"
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"


def _our_hooks():
    from langchain_core.tracers.context import _configure_hooks

    return [h for h in _configure_hooks if getattr(h[0], "name", "") == "areal_langchain_handler"]


def test_remove_routing_restores_langchain(gateway):
    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    host.install_routing(GatewayRoute(gateway.url))  # idempotent: one handler
    assert len(_our_hooks()) == 1
    host.remove_routing()
    assert _our_hooks() == []


def test_disable_env_blocks_the_plugin_and_the_openai_adapter_still_routes(
    gateway, scope, monkeypatch
):
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "langchain")
    host = PluginHost()
    record = {r.name: r for r in host.plugins()}["langchain"]
    assert not record.status.usable
    assert "AREAL_SDK_DISABLE_PLUGINS" in record.status.reason
    host.install_routing(GatewayRoute(gateway.url))
    try:
        assert _our_hooks() == []

        @areal.trace
        def agent(task):
            return langchain_openai.ChatOpenAI(model="m", api_key="user-key").invoke("hi").content

        with rollout_scope(scope):
            assert agent({}) == "[gateway] hi"  # the openai adapter routes the SDK call
        assert "langchain" not in gateway.requests[0].metadata
    finally:
        host.remove_routing()
