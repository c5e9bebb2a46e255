"""The one switch for the frameworks' own telemetry (``agent.framework_telemetry``): off
while routing is installed, as the user left it once routing is removed.

A module of its own: the rollout stack of ``test_capture.py`` keeps routing installed for
that whole module, and routing stays until its last installer removes it."""

from __future__ import annotations

import importlib.util

import pytest

from areal_sdk.config import load_config
from areal_sdk.plugin_host import PluginHost


def _needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{missing} not installed")


@_needs("agents", "langsmith")
def test_framework_telemetry_is_off_during_rollouts_unless_the_config_turns_it_on(
    gateway, monkeypatch
):
    import langsmith.utils
    from agents.tracing.processors import default_processor
    from areal_sdk.plugins import openai_agents

    from areal_sdk.hookspecs import GatewayRoute

    monkeypatch.setenv("LANGSMITH_TRACING", "true")
    langsmith.utils.get_env_var.cache_clear()
    cfg = load_config(None, ["agent.framework_telemetry=true"])
    host = PluginHost()
    try:
        for allowed in (False, cfg.agent.framework_telemetry):
            host.install_routing(GatewayRoute(gateway.url, framework_telemetry=allowed))
            exporting = default_processor() in openai_agents._processors()
            assert (exporting, langsmith.utils.tracing_is_enabled()) == (allowed, allowed)
            host.remove_routing()
            # routing gone: the frameworks are as the user left them
            assert default_processor() in openai_agents._processors()
            assert langsmith.utils.tracing_is_enabled() is True
    finally:
        host.remove_routing()
        langsmith.utils.get_env_var.cache_clear()
