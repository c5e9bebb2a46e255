"""What ``areal-sdk plugins`` learns from the adapters: usable, or missing with the extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import areal_sdk as areal
from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.plugin_host import PluginHost
from areal_sdk.tracing import rollout_scope

ADAPTERS = {  # entry-point name -> (framework module, extra)
    "openai": ("openai", "openai"),
    "anthropic": ("anthropic", "anthropic"),
    "langchain": ("langchain_core", "langchain"),
    "openai_agents": ("agents", "openai-agents"),
    "camel": ("camel", "camel"),
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_each_adapter_reports_its_framework_and_extra(name):
    module, extra = ADAPTERS[name]
    host = PluginHost()
    record = {r.name: r for r in host.plugins()}[name]
    infos = [info for info, rec in host.adapters() if rec.name == name]
    assert [i.extra for i in infos] == [extra]
    if importlib.util.find_spec(module) is None:
        assert not record.status.usable
        assert record.status.extra == extra
        assert f'pip install "areal-sdk[{extra}]"' in record.status.reason
    else:
        assert record.status.usable, record.status.reason
        assert "adapter" in record.kinds


def test_a_missing_framework_is_reported_and_the_other_adapters_still_route(
    monkeypatch, gateway, scope
):
    # Hide LangChain: importlib finds no module whose sys.modules entry is None.
    for module in [m for m in sys.modules if m.startswith("langchain_core")] or ["langchain_core"]:
        monkeypatch.setitem(sys.modules, module, None)
    host = PluginHost()
    record = {r.name: r for r in host.plugins()}["langchain"]
    assert not record.status.usable
    assert record.status.extra == "langchain"
    assert 'pip install "areal-sdk[langchain]"' in record.status.reason

    openai = pytest.importorskip("openai")
    host.install_routing(GatewayRoute(gateway.url))
    try:

        @areal.trace
        def agent(task):
            reply = openai.OpenAI().chat.completions.create(
                model="m", messages=[{"role": "user", "content": "still routed"}]
            )
            return reply.choices[0].message.content

        with rollout_scope(scope):
            assert agent({}) == "[gateway] still routed"
    finally:
        host.remove_routing()


def test_disabled_adapter_is_listed_as_disabled(monkeypatch):
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "langchain,camel")
    records = {r.name: r for r in PluginHost().plugins()}
    for name in ("langchain", "camel"):
        assert not records[name].loaded
        assert "disabled by AREAL_SDK_DISABLE_PLUGINS" in records[name].status.reason
    assert records["openai"].loaded


def test_loading_the_adapters_imports_no_framework():
    code = (
        "import sys\n"
        "from areal_sdk.plugin_host import PluginHost\n"
        "host = PluginHost()\n"
        "host.plugins(); host.adapters()\n"
        "loaded = [m for m in ('openai', 'anthropic', 'langchain_core', 'langchain_openai',"
        " 'agents', 'camel') if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""
