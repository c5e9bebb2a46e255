"""The anthropic adapter, driven with the real anthropic client against recorder servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

import areal_sdk as areal
from areal_sdk.tracing import rollout_scope
from tests.plugins.conftest import Blocked, subprocess_env

anthropic = pytest.importorskip(
    "anthropic", reason="anthropic not installed: pip install 'areal-sdk[anthropic]'"
)

MODEL = "claude-sonnet-4-5"


def ask(client, text: str) -> str:
    reply = client.messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": text}]
    )
    return reply.content[0].text


def test_default_client_in_an_episode_goes_to_the_gateway_with_the_episode_key(
    host, scope, gateway
):
    @areal.trace
    def agent(task):
        return ask(anthropic.Anthropic(), "hello")

    with rollout_scope(scope):
        assert agent({}) == "[gateway] hello"
    (req,) = gateway.requests
    key = f"key-{scope.episodes[0].id}"
    assert req.path == "/v1/messages"
    assert req.headers["x-api-key"] == key
    assert req.bearer == key
    assert req.body["model"] == MODEL


def test_tool_use_loop_goes_to_the_gateway(host, scope, gateway):
    tools = [
        {
            "name": "get_weather",
            "description": "Weather in a city",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]

    @areal.trace
    def agent(task):
        client = anthropic.Anthropic()
        messages = [{"role": "user", "content": "weather in Tokyo?"}]
        reply = client.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=messages)
        assert reply.stop_reason == "tool_use"
        use = reply.content[0]
        messages += [
            {"role": "assistant", "content": reply.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ]
        final = client.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=messages)
        return final.stop_reason

    with rollout_scope(scope):
        assert agent({}) == "end_turn"
    assert len(gateway.requests) == 2


def test_base_url_in_code_is_untouched_and_an_env_address_is_routed(
    host, scope, gateway, other, monkeypatch
):
    @areal.trace
    def agent(task):
        explicit = ask(anthropic.Anthropic(base_url=other.url, api_key="judge"), "explicit")
        # An address from the environment is the user's default, not a judge: routed.
        monkeypatch.setenv("ANTHROPIC_BASE_URL", other.url)
        from_env = ask(anthropic.Anthropic(api_key="vendor"), "env")
        return [explicit, from_env]

    with rollout_scope(scope):
        assert agent({}) == ["[other] explicit", "[gateway] env"]
    # anthropic 2.x sends the key as a bearer token, 0.x as x-api-key
    assert [r.api_key for r in other.requests] == ["judge"]
    assert [r.api_key for r in gateway.requests] == [f"key-{scope.episodes[0].id}"]


def test_outside_an_episode_nothing_changes(host, gateway, request_log):
    client = anthropic.Anthropic(
        api_key="user-key",
        http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [request_log]}),
        max_retries=0,
    )
    with pytest.raises((Blocked, anthropic.APIConnectionError)):
        ask(client, "no episode")
    assert request_log.urls == ["https://api.anthropic.com/v1/messages"]
    sent = request_log.headers[0]
    assert sent.get("x-api-key") == "user-key" or sent.get("authorization") == "Bearer user-key"
    assert gateway.requests == []


async def test_eight_concurrent_async_episodes_without_cross_talk(host, scope, gateway):
    shared = anthropic.AsyncAnthropic(api_key="user-key")

    @areal.trace
    async def agent(task):
        reply = await shared.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": task["id"]}]
        )
        return 1.0 if reply.content[0].text.endswith(task["id"]) else 0.0

    with rollout_scope(scope):
        assert await asyncio.gather(*(agent({"id": f"t{i}"}) for i in range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway)


def test_eight_threaded_episodes_without_cross_talk(host, scope, gateway):
    shared = anthropic.Anthropic(api_key="user-key")

    @areal.trace
    def agent(task):
        ask(shared, task["id"])
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
    for req in gateway.requests:
        assert req.headers["x-api-key"] == key_of_task[req.body["messages"][0]["content"]]


SUBPROCESS_AGENT = textwrap.dedent(
    """
    import anthropic
    reply = anthropic.Anthropic().messages.create(
        model="claude-sonnet-4-5", max_tokens=8, messages=[{"role": "user", "content": "sub"}])
    print(reply.content[0].text)
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
            timeout=60,
            check=True,
        )
        return out.stdout.strip()

    with rollout_scope(scope):
        assert agent({}) == "[gateway] sub"
    assert gateway.requests[0].api_key == f"key-{scope.episodes[0].id}"


def test_remove_routing_restores_the_sdk(gateway):
    from anthropic._base_client import BaseClient

    from areal_sdk.hookspecs import GatewayRoute
    from areal_sdk.plugin_host import PluginHost

    original = BaseClient._build_request
    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    assert BaseClient._build_request is not original
    host.remove_routing()
    assert BaseClient._build_request is original
