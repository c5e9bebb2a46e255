"""What is captured, through the real stack (tiny model, embedded engine, gateway, store):
child processes, clients whose address comes from the environment, agents whose calls
never reach the gateway, and framework exporters that would send rollouts elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import areal_sdk as areal
from areal_sdk.config import load_config
from areal_sdk.launcher import LocalStack
from areal_sdk.plugin_host import PluginHost
from areal_sdk.rollout import RolloutController
from areal_sdk.store import TrajectoryStore
from areal_sdk.tracing import NO_MODEL_CALL

pytestmark = pytest.mark.slow

VENDOR_KEYS = {"OPENAI_API_KEY": "sk-vendor", "ANTHROPIC_API_KEY": "sk-ant-vendor"}

# An agent's helper script: plain SDK clients, configured by nothing but the environment.
CHILD = """
import sys, anthropic, openai
question = sys.argv[1]
openai.OpenAI(max_retries=0, timeout=30).chat.completions.create(
    model="gpt-4o", max_tokens=4, messages=[{"role": "user", "content": question}]
)
anthropic.Anthropic(max_retries=0, timeout=30).messages.create(
    model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": question}]
)
"""


def _needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{missing} not installed")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[LocalStack]:
    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", "inference.max_new_tokens=4", "inference.device=cpu"]
    )
    store = TrajectoryStore(tmp_path_factory.mktemp("store"))
    host = PluginHost()
    if "embedded" not in host.inference_backends():
        from areal_sdk.backends.embedded import plugin as engine_plugin

        host.register(engine_plugin, "embedded")
    if "hermes" not in host.tool_call_parsers():
        from areal_sdk.gateway import plugin as gateway_plugin

        host.register(gateway_plugin, "gateway")
    with LocalStack(cfg, store, host=host) as running:
        yield running


class Listener:
    """A loopback HTTP server that counts every request, whatever its path or body."""

    def __init__(self) -> None:
        paths: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                paths.append(self.path)
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_PATCH = _any

            def log_message(self, *args: object) -> None:
                return None

        self.paths = paths
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def _run(stack, agent, n: int, run_id: str, **kwargs):
    controller = RolloutController(agent, stack.sessions(run_id), concurrency=4, timeout_s=120)
    tasks = [{"id": f"{run_id}-{i}", "question": f"What is {i} + 1?"} for i in range(n)]
    return asyncio.run(controller.run(tasks)), controller


def _apis(episode) -> list[str]:
    return sorted(turn.api for turn in episode.turns)


@_needs("openai", "anthropic")
def test_a_child_process_of_the_agent_calls_into_its_episode(stack, monkeypatch):
    for name, value in VENDOR_KEYS.items():  # the child must not reach the vendor with these
        monkeypatch.setenv(name, value)

    @areal.trace
    def agent(task):  # no env=: the child inherits this process's environment
        subprocess.run([sys.executable, "-c", CHILD, task["question"]], check=True, timeout=90)
        return 1.0

    @areal.trace
    async def async_agent(task):  # an env of its own, copied from os.environ
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, task["question"], env={**os.environ, "TOOL": "1"}
        )
        assert await proc.wait() == 0
        return 1.0

    for fn, run_id in ((agent, "child"), (async_agent, "achild")):
        summary, _ = _run(stack, fn, 2, run_id)
        assert [e.error for e in summary.episodes] == [None, None]
        for episode in summary.episodes:
            assert _apis(episode) == ["anthropic.messages", "openai.chat"]
            # each child's calls landed in its own episode
            assert all(
                episode.task_id.split("-")[-1] + " + 1" in str(t.request) for t in episode.turns
            )


def test_a_child_keeps_the_routing_variables_its_caller_set():
    from areal_sdk.plugins._routing import ChildProcessEnv, Target

    target = Target("http://127.0.0.1:9", "sk-areal-episode")
    env = ChildProcessEnv.child_env({"OPENAI_BASE_URL": "http://judge/v1", "PATH": "/bin"}, target)
    assert env["OPENAI_BASE_URL"] == "http://judge/v1"  # set by the caller: kept
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "sk-areal-episode"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["PATH"] == "/bin"


@_needs("openai", "anthropic", "langchain_openai", "langchain_anthropic")
def test_clients_with_an_address_from_the_environment_are_routed(
    stack, other_server, listener, monkeypatch
):
    import anthropic
    import openai
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    for name, value in VENDOR_KEYS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OPENAI_BASE_URL", listener.url + "/v1")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", listener.url)

    @areal.trace
    def agent(task):
        q = task["question"]
        openai.OpenAI().chat.completions.create(
            model="gpt-4o", max_tokens=4, messages=[{"role": "user", "content": q}]
        )
        anthropic.Anthropic().messages.create(
            model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": q}]
        )
        ChatOpenAI(model="gpt-4o-mini", max_tokens=4).invoke(q)
        ChatAnthropic(model="claude-sonnet-4-5", max_tokens=4).invoke(q)
        # An address given in code is a judge on another API: left alone.
        judge = openai.OpenAI(base_url=other_server.url + "/v1", api_key="judge")
        judge.chat.completions.create(model="judge", messages=[{"role": "user", "content": q}])
        return 1.0

    summary, _ = _run(stack, agent, 2, "env")
    assert [e.error for e in summary.episodes] == [None, None]
    for episode in summary.episodes:
        assert _apis(episode) == ["anthropic.messages"] * 2 + ["openai.chat"] * 2
    assert listener.paths == []
    assert [r.api_key for r in other_server.requests] == ["judge", "judge"]


@_needs("agents")
def test_the_agents_sdk_with_an_env_address_is_routed_and_exports_no_traces(
    stack, other_server, listener, monkeypatch
):
    from agents import Agent, ModelSettings, Runner
    from agents.exceptions import ModelBehaviorError
    from agents.tracing import flush_traces
    from agents.tracing.processors import default_exporter

    # The SDK's exporter sends traces wherever its endpoint says when a key is set.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-vendor")
    monkeypatch.setenv("OPENAI_BASE_URL", other_server.url + "/v1")
    monkeypatch.setattr(default_exporter(), "endpoint", listener.url + "/traces/ingest")
    helper = Agent(
        name="Helper",
        instructions="Answer briefly.",
        model_settings=ModelSettings(max_tokens=4, temperature=0.0),
    )

    @areal.trace
    async def agent(task):
        with contextlib.suppress(ModelBehaviorError):  # a random tiny model stops at max_tokens
            await Runner.run(helper, task["question"], max_turns=1)
        return 1.0

    summary, _ = _run(stack, agent, 2, "agents-env")
    flush_traces()
    assert [e.error for e in summary.episodes] == [None, None]
    assert all(_apis(e) == ["openai.responses"] for e in summary.episodes)
    assert other_server.requests == []
    assert listener.paths == []  # no span of a rollout left for the vendor's ingestion


@_needs("langchain_openai", "langsmith")
def test_langsmith_tracing_from_the_environment_sends_nothing(stack, listener, monkeypatch):
    import langsmith.utils
    from langchain_core.tracers.langchain import wait_for_all_tracers
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("LANGSMITH_TRACING", "true")
    monkeypatch.setenv("LANGSMITH_API_KEY", "lsv2-test")
    monkeypatch.setenv("LANGSMITH_ENDPOINT", listener.url)
    langsmith.utils.get_env_var.cache_clear()  # langsmith caches what it read
    enabled = []

    @areal.trace
    async def agent(task):
        enabled.append(langsmith.utils.tracing_is_enabled())
        await ChatOpenAI(model="gpt-4o-mini", max_tokens=4).ainvoke(task["question"])
        return 1.0

    try:
        summary, _ = _run(stack, agent, 2, "langsmith")
        wait_for_all_tracers()
    finally:
        langsmith.utils.get_env_var.cache_clear()
    assert [e.error for e in summary.episodes] == [None, None]
    assert enabled == [False, False]
    assert listener.paths == []


@_needs("openai")
def test_an_episode_whose_calls_never_reach_the_gateway_fails_and_never_trains(
    stack, other_server, caplog
):
    import openai

    @areal.trace
    def agent(task):
        judge = openai.OpenAI(base_url=other_server.url + "/v1", api_key="judge")
        judge.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return 1.0

    with caplog.at_level(logging.WARNING, logger="areal_sdk.rollout"):
        summary, controller = _run(stack, agent, 3, "nocall")
    assert [e.status for e in summary.episodes] == ["failed"] * 3
    assert all(e.error == NO_MODEL_CALL for e in summary.episodes)
    assert NO_MODEL_CALL.startswith("no model call captured")
    assert controller.no_model_call == 3 and summary.as_dict()["episodes_no_model_call"] == 3
    warnings = [r for r in caplog.records if NO_MODEL_CALL in r.getMessage()]
    assert len(warnings) == 1  # the first one warns; the metric counts them all
    stored = [stack.store.get(e.id) for e in summary.episodes]
    assert all(s.status == "failed" and s.error == NO_MODEL_CALL for s in stored)
    metrics = httpx.get(stack.url + "/metrics").text
    assert 'areal_gateway_sessions_total{event="no_model_call"} 3.0' in metrics
