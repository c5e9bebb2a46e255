"""The openai adapter, driven with the real openai client against recorder servers."""

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

openai = pytest.importorskip(
    "openai", reason="openai not installed: pip install 'areal-sdk[openai]'"
)


def ask(client, text: str) -> str:
    reply = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": text}]
    )
    return reply.choices[0].message.content


def test_default_client_in_an_episode_goes_to_the_gateway_with_the_episode_key(
    host, scope, gateway
):
    @areal.trace
    def agent(task):
        return ask(openai.OpenAI(), task["q"])

    with rollout_scope(scope):
        answer = agent({"id": "t1", "q": "hello"})

    assert answer == "[gateway] hello"
    (req,) = gateway.requests
    assert req.path == "/v1/chat/completions"
    assert req.bearer == f"key-{scope.episodes[0].id}"
    assert req.body["model"] == "gpt-4o"


def test_client_built_without_any_key_works_while_routing_is_installed(gateway, scope):
    from areal_sdk.hookspecs import GatewayRoute
    from areal_sdk.plugin_host import PluginHost

    # No OPENAI_API_KEY anywhere: without routing the SDK refuses to build the client.
    with pytest.raises(openai.OpenAIError):
        openai.OpenAI()
    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    try:
        module_level = openai.OpenAI()  # an agent module building its client at import

        @areal.trace
        def agent(task):
            return [ask(openai.OpenAI(), "built inside"), ask(module_level, "built before")]

        with rollout_scope(scope):
            assert agent({}) == ["[gateway] built inside", "[gateway] built before"]
        key = f"key-{scope.episodes[0].id}"
        assert [r.bearer for r in gateway.requests] == [key, key]
    finally:
        host.remove_routing()
    with pytest.raises(openai.OpenAIError):
        openai.OpenAI()


def test_client_pointed_elsewhere_is_untouched(host, scope, gateway, other):
    judge = openai.OpenAI(base_url=other.url + "/v1", api_key="judge-key")

    @areal.trace
    def agent(task):
        ask(openai.OpenAI(), "policy call")
        return ask(judge, "judge call")

    with rollout_scope(scope):
        assert agent({}) == "[other] judge call"
    assert [r.body["messages"][0]["content"] for r in gateway.requests] == ["policy call"]
    (judged,) = other.requests
    assert judged.bearer == "judge-key"
    assert "x-areal-metadata" not in judged.headers


def test_route_off_header_keeps_a_default_client_on_its_api(host, scope, gateway, request_log):
    client = openai.OpenAI(
        api_key="real-key",
        default_headers={"x-areal-route": "off"},
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [request_log]}),
        max_retries=0,
    )

    @areal.trace
    def agent(task):
        with pytest.raises((Blocked, openai.APIConnectionError)):
            ask(client, "to the real api")

    with rollout_scope(scope):
        agent({})
    assert request_log.urls == ["https://api.openai.com/v1/chat/completions"]
    assert gateway.requests == []


def test_outside_an_episode_nothing_changes(host, gateway, request_log, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "user-key")
    client = openai.OpenAI(
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [request_log]}), max_retries=0
    )
    with pytest.raises((Blocked, openai.APIConnectionError)):
        ask(client, "no episode")
    assert request_log.urls == ["https://api.openai.com/v1/chat/completions"]
    assert request_log.headers[0]["authorization"] == "Bearer user-key"
    assert gateway.requests == []


def test_client_built_before_the_episode_routes_only_inside_it(
    host, scope, gateway, request_log, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", "user-key")
    client = openai.OpenAI(
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [request_log]}), max_retries=0
    )

    @areal.trace
    def agent(task):
        return client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "inside"}]
        )

    with rollout_scope(scope):
        agent({})
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"
    with pytest.raises((Blocked, openai.APIConnectionError)):
        ask(client, "after")
    assert request_log.urls == [
        gateway.url + "/v1/chat/completions",
        "https://api.openai.com/v1/chat/completions",
    ]


def test_streaming_raw_response_and_responses_api(host, scope, gateway):
    @areal.trace
    def agent(task):
        client = openai.OpenAI()
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "streamed"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "raw"}]
        )
        parsed = raw.parse().choices[0].message.content
        resp = client.responses.create(model="m", input="responses")
        return [text, parsed, resp.output_text]

    with rollout_scope(scope):
        out = agent({})
    assert out == ["[gateway] streamed", "[gateway] raw", "[gateway] responses"]
    key = f"key-{scope.episodes[0].id}"
    assert [(r.path, r.bearer) for r in gateway.requests] == [
        ("/v1/chat/completions", key),
        ("/v1/chat/completions", key),
        ("/v1/responses", key),
    ]


def test_client_pointed_at_the_gateway_gets_the_episode_key(host, scope, gateway):
    @areal.trace
    def agent(task):
        return ask(openai.OpenAI(base_url=gateway.url + "/v1", api_key="stale"), "x")

    with rollout_scope(scope):
        agent({})
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"


async def test_eight_concurrent_async_episodes_share_a_client_without_cross_talk(
    host, scope, gateway
):
    shared = openai.AsyncOpenAI()  # built outside any episode, with no key of its own

    @areal.trace
    async def agent(task):
        for turn in range(2):
            reply = await shared.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"{task['id']}/{turn}"}]
            )
            await asyncio.sleep(0)
        return 1.0 if reply.choices[0].message.content.endswith(f"{task['id']}/1") else 0.0

    with rollout_scope(scope):
        rewards = await asyncio.gather(*(agent({"id": f"t{i}"}) for i in range(8)))
    assert rewards == [1.0] * 8
    _assert_no_cross_talk(scope, gateway, calls_per_episode=2)


def test_eight_threaded_episodes_without_cross_talk(host, scope, gateway, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "user-key")
    shared = openai.OpenAI()

    @areal.trace
    def agent(task):
        for turn in range(2):
            ask(shared, f"{task['id']}/{turn}")
        return 1.0

    def run(i):
        with rollout_scope(scope):
            return agent({"id": f"t{i}"})

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == [1.0] * 8
    _assert_no_cross_talk(scope, gateway, calls_per_episode=2)


def _assert_no_cross_talk(scope, gateway, *, calls_per_episode: int) -> None:
    key_of_task = {ep.task_id: f"key-{ep.id}" for ep in scope.episodes}
    assert len(key_of_task) == 8
    assert len(gateway.requests) == 8 * calls_per_episode
    for req in gateway.requests:
        task_id = req.body["messages"][-1]["content"].split("/")[0]
        assert req.bearer == key_of_task[task_id]


SUBPROCESS_AGENT = textwrap.dedent(
    """
    import openai
    reply = openai.OpenAI().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "from a subprocess"}])
    print(reply.choices[0].message.content)
    """
)


def test_a_subprocess_agent_gets_the_episode_through_env(scope, gateway):

    @areal.trace
    def agent(task):
        ctx = areal.current_episode()
        out = subprocess.run(
            [sys.executable, "-c", SUBPROCESS_AGENT],
            env=subprocess_env(ctx),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.strip()

    with rollout_scope(scope):
        assert agent({}) == "[gateway] from a subprocess"
    assert gateway.requests[0].bearer == f"key-{scope.episodes[0].id}"


def test_remove_routing_restores_the_sdk(gateway, scope, request_log):
    from openai._base_client import BaseClient

    from areal_sdk.hookspecs import GatewayRoute
    from areal_sdk.plugin_host import PluginHost

    original = BaseClient._build_request
    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    host.install_routing(GatewayRoute(gateway.url))  # idempotent
    assert BaseClient._build_request is not original
    host.remove_routing()
    assert BaseClient._build_request is original

    client = openai.OpenAI(
        api_key="user-key",
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [request_log]}),
        max_retries=0,
    )

    @areal.trace
    def agent(task):
        with pytest.raises((Blocked, openai.APIConnectionError)):
            ask(client, "after removal")

    with rollout_scope(scope):
        agent({})
    assert request_log.urls == ["https://api.openai.com/v1/chat/completions"]
    assert gateway.requests == []
