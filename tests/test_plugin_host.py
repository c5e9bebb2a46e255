"""The plugin host against real entry points of a real (temporary) third-party distribution."""

import textwrap

import pytest

from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.plugin_host import PluginError, PluginHost

PLUGIN = textwrap.dedent(
    """
    from areal_sdk.hookspecs import AdapterInfo, hookimpl
    from areal_sdk.plugin_host import status_for_modules

    EVENTS = []

    @hookimpl
    def areal_reward_functions():
        return {"always_one": lambda completion, task: 1.0}

    @hookimpl
    def areal_inference_backends():
        return {"echo": lambda config: "echo-backend"}

    @hookimpl
    def areal_train_backends():
        return {"third_train": lambda config: "train"}

    @hookimpl
    def areal_weight_sync_methods():
        return {"carrier_pigeon": lambda config: "sync"}

    @hookimpl
    def areal_tool_call_parsers():
        return {"xml_calls": lambda text: ([], text)}

    @hookimpl
    def areal_metric_sinks():
        return {"stdout": lambda run_dir: "sink"}

    @hookimpl
    def areal_install_routing(route):
        EVENTS.append(("install", route.openai_base_url))

    @hookimpl
    def areal_remove_routing():
        EVENTS.append(("remove",))

    @hookimpl
    def areal_episode_started(episode):
        EVENTS.append(("started", episode.id))

    @hookimpl
    def areal_turn_recorded(episode_id, turn):
        EVENTS.append(("turn", episode_id, turn.id))

    @hookimpl
    def areal_episode_ended(episode):
        EVENTS.append(("ended", episode.id))
    """
)

MISSING_FRAMEWORK = textwrap.dedent(
    """
    from areal_sdk.hookspecs import AdapterInfo, hookimpl
    from areal_sdk.plugin_host import status_for_modules

    @hookimpl
    def areal_plugin_status():
        return status_for_modules(("no_such_framework_xyz",), extra="xyz", kind="adapter")

    @hookimpl
    def areal_adapters():
        return [AdapterInfo("xyz", "XYZ Agents", ("no_such_framework_xyz",), "xyz")]

    @hookimpl
    def areal_reward_functions():
        return {"xyz_reward": lambda c, t: 0.0}

    @hookimpl
    def areal_install_routing(route):
        raise AssertionError("an unusable plugin must not be asked to route")
    """
)

CLASHING = textwrap.dedent(
    """
    from areal_sdk.hookspecs import hookimpl

    @hookimpl
    def areal_reward_functions():
        return {"always_one": lambda completion, task: 0.0}
    """
)


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Install a distribution with four plugins into a directory on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "tp_good.py").write_text(PLUGIN)
    (site / "tp_missing.py").write_text(MISSING_FRAMEWORK)
    (site / "tp_broken.py").write_text("raise RuntimeError('plugin import exploded')\n")
    (site / "tp_clash.py").write_text(CLASHING)
    info = site / "tp_plugins-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tp-plugins\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(
        "[areal_sdk]\ntp_good = tp_good\ntp_missing = tp_missing\ntp_broken = tp_broken\ntp_clash = tp_clash\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "tp_clash")
    import importlib

    importlib.invalidate_caches()
    yield site


def records(host):
    return {r.name: r for r in host.plugins()}


def test_entry_points_are_discovered_with_their_source(third_party):
    host = PluginHost()
    recs = records(host)
    assert recs["tp_good"].source == "tp-plugins 1.2"
    assert recs["tp_good"].status.usable
    assert set(recs["tp_good"].kinds) >= {
        "reward",
        "inference_backend",
        "train_backend",
        "weight_sync",
        "tool_parser",
        "metric_sink",
    }


def test_broken_and_missing_plugins_are_reported_not_fatal(third_party):
    host = PluginHost()
    recs = records(host)
    assert not recs["tp_broken"].status.usable
    assert "import failed: RuntimeError: plugin import exploded" in recs["tp_broken"].status.reason
    missing = recs["tp_missing"].status
    assert not missing.usable and missing.extra == "xyz"
    assert 'pip install "areal-sdk[xyz]"' in missing.reason
    assert "adapter" in recs["tp_missing"].kinds
    # An unusable plugin's components are not offered.
    assert "xyz_reward" not in host.reward_functions()
    # Asked for by name, it says which plugin has it and what makes that plugin usable.
    with pytest.raises(
        PluginError,
        match="reward 'xyz_reward' \\(plugin 'tp_missing'\\) is unusable here: missing no_such_framework_xyz",
    ):
        host.reward_function("xyz_reward")


def test_disable_env_blocks_a_plugin(third_party, monkeypatch):
    host = PluginHost()
    assert records(host)["tp_clash"].status.reason == "disabled by AREAL_SDK_DISABLE_PLUGINS"
    assert host.reward_function("always_one")("x", {}) == 1.0
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "tp_good")
    host = PluginHost()
    assert not records(host)["tp_good"].status.usable
    assert host.reward_function("always_one")("x", {}) == 0.0  # now only the clashing one


def test_two_plugins_registering_one_name_is_an_error(third_party, monkeypatch):
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "")
    host = PluginHost()
    with pytest.raises(PluginError, match="'always_one' is registered by both"):
        host.reward_functions()


def test_typed_registries_resolve_by_name(third_party):
    host = PluginHost()
    assert host.inference_backend("echo")(None) == "echo-backend"
    assert host.train_backend("third_train")(None) == "train"
    assert host.weight_sync_method("carrier_pigeon")(None) == "sync"
    assert host.tool_call_parser("xml_calls")("hi") == ([], "hi")
    assert host.metric_sink("stdout")(None) == "sink"
    assert "echo" in host.inference_backends() and "third_train" in host.train_backends()
    assert (
        "carrier_pigeon" in host.weight_sync_methods() and "xml_calls" in host.tool_call_parsers()
    )
    assert "stdout" in host.metric_sinks()
    with pytest.raises(PluginError, match="no inference backend named 'nope'; known: .*echo"):
        host.inference_backend("nope")
    adapters = {info.name: rec.name for info, rec in host.adapters()}
    assert adapters["xyz"] == "tp_missing"


def test_routing_and_lifecycle_hooks_reach_usable_plugins_only(third_party):
    import tp_good

    from areal_sdk.tracing import EpisodeContext
    from areal_sdk.trajectory import Episode, Turn

    host = PluginHost()
    tp_good.EVENTS.clear()
    ep = Episode(task_id="t")
    turn = Turn(api="openai.chat", prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0])
    host.install_routing(GatewayRoute("http://127.0.0.1:1234"))
    host.episode_started(EpisodeContext(episode=ep, name="a"))
    host.turn_recorded(ep.id, turn)
    host.episode_ended(ep)
    host.remove_routing()
    assert [
        ("install", "http://127.0.0.1:1234/v1"),
        ("started", ep.id),
        ("turn", ep.id, turn.id),
        ("ended", ep.id),
        ("remove",),
    ] == tp_good.EVENTS


def test_register_in_code_and_unregister():
    from areal_sdk.hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def areal_plugin_status(self):
            return None

        @hookimpl
        def areal_reward_functions(self):
            return {"half": lambda c, t: 0.5}

    host = PluginHost(load_entry_points=False)
    host.register(Plugin(), "inline")
    assert records(host)["inline"].source == "registered in code"
    assert host.reward_function("half")("", {}) == 0.5
    host.unregister("inline")
    assert host.reward_functions() == {}


def test_importing_the_package_loads_no_plugin():
    import subprocess
    import sys

    code = (
        "import sys, areal_sdk; print(any(m.startswith('areal_sdk.plugins.') for m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
        == "False"
    )


def test_a_plugin_whose_routing_fails_is_unusable_and_the_others_still_route(third_party):
    import tp_good

    from areal_sdk.hookspecs import hookimpl

    class Shadowed:
        """What an adapter meets when a user's ``agents.py`` hides its framework."""

        removed = False

        @hookimpl
        def areal_install_routing(self, route):
            from agents_shadowed_xyz.tracing import add_trace_processor  # noqa: F401

        @hookimpl
        def areal_remove_routing(self):
            Shadowed.removed = True

    host = PluginHost()
    host.register(Shadowed(), "shadowed")
    tp_good.EVENTS.clear()
    host.install_routing(GatewayRoute("http://127.0.0.1:1234"))
    assert tp_good.EVENTS == [("install", "http://127.0.0.1:1234/v1")]
    status = records(host)["shadowed"].status
    assert not status.usable
    assert status.reason.startswith("routing failed: ModuleNotFoundError")
    assert Shadowed.removed  # what it had installed is undone
    host.remove_routing()
    assert tp_good.EVENTS[-1] == ("remove",)


def test_the_extra_for_a_missing_module():
    from areal_sdk.plugin_host import extra_for_module

    assert extra_for_module("agents.tracing") == "openai-agents"  # adapters' import names
    assert extra_for_module("camel") == "camel"
    assert extra_for_module("langchain") == "langchain"  # from areal-sdk's own metadata
    assert extra_for_module("langchain_anthropic") == "langchain"
    assert extra_for_module("deepspeed") == "deepspeed"
    assert extra_for_module("no_such_package_xyz") is None
