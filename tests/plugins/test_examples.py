"""The framework examples, end to end on CPU: each example's own config (with the tiny test
model swapped in), its agent loaded from ``agent.entry``, run by the rollout controller against
the real gateway and embedded engine. Every episode must record its calls as turns."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from areal_sdk.config import load_config
from areal_sdk.plugin_host import PluginHost

launcher = pytest.importorskip("areal_sdk.launcher", reason="the local launcher is not built yet")
from areal_sdk.plugin_host import get_host  # noqa: E402
from areal_sdk.rollout import RolloutController  # noqa: E402
from areal_sdk.store import TrajectoryStore  # noqa: E402
from areal_sdk.tasks import load_agent, load_tasks  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {  # example dir -> (framework module, the API its calls use)
    "openai_sdk": ("openai", "openai.chat"),
    "anthropic_sdk": ("anthropic", "anthropic.messages"),
    "langchain": ("langgraph", "openai.chat"),
    "openai_agents": ("agents", "openai.responses"),
    "camel": ("camel", "openai.chat"),
}
# Errors a random tiny model can provoke in a framework (it stops mid-answer or emits a
# malformed tool call); anything else, above all a routing error, fails the test.
MODEL_ERRORS = ("ModelBehaviorError", "ValidationError", "GraphRecursionError", "MaxTurnsExceeded")


def _host() -> PluginHost:
    host = get_host()
    if "embedded" not in host.inference_backends():  # until their entry points are declared
        from areal_sdk.backends.embedded import plugin as engine_plugin

        host.register(engine_plugin, "embedded")
    if "hermes" not in host.tool_call_parsers():
        from areal_sdk.gateway import plugin as gateway_plugin

        host.register(gateway_plugin, "gateway")
    return host


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_config_is_valid(example):
    cfg = load_config(REPO / "examples" / example / "config.yaml")
    assert cfg.agent.entry == "agent:solve"  # agent.py beside the config
    assert cfg.agent.reward == "numeric_match"
    assert (REPO / cfg.data.path).is_file()
    assert cfg.inference.device == "cpu"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_runs_end_to_end_on_cpu(example, tiny_model_dir, tmp_path, monkeypatch):
    module, api = EXAMPLES[example]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed (see docs/extras.md)")
    monkeypatch.chdir(tmp_path)  # a config runs from any directory
    cfg = load_config(
        REPO / "examples" / example / "config.yaml",
        [
            "model.name=null",
            f"model.path={tiny_model_dir}",
            "data.limit=2",
            "inference.max_new_tokens=16",
        ],
    )
    store = TrajectoryStore(tmp_path / "run")
    host = _host()
    reward = host.reward_function(cfg.agent.reward)
    with launcher.LocalStack(cfg, store, host=host) as stack:
        # After routing, and beside the config first, as the CLI does.
        agent = load_agent(cfg.agent.entry, search_path=REPO / "examples" / example)
        tasks = load_tasks(cfg.data.path, limit=cfg.data.limit)
        sessions = stack.sessions(example)
        controller = RolloutController(
            agent,
            sessions,
            concurrency=cfg.rollout.concurrency,
            timeout_s=cfg.rollout.timeout_s,
            reward_fn=reward,
        )

        summary = asyncio.run(controller.run(tasks))
    assert len(summary.episodes) == 2
    for episode in summary.episodes:
        assert episode.turns, f"{example}: no turn recorded ({episode.error})"
        assert {t.api for t in episode.turns} == {api}
        question = next(t["question"] for t in tasks if t["id"] == episode.task_id)
        assert question in str(episode.turns[0].request)
        if episode.error is not None:
            assert any(kind in episode.error for kind in MODEL_ERRORS), episode.error
        else:
            assert episode.reward in (0.0, 1.0)
