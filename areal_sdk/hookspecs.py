"""Every extension point of areal-sdk, in one place.

A plugin is a module (or object) with functions named like the specs below, marked with
``@areal_sdk.hookimpl``, and registered through the entry-point group ``areal_sdk``::

    [project.entry-points.areal_sdk]
    my_plugin = "my_package.areal_plugin"

The built-in adapters and backends load through that same group. Core code never calls
``pm.hook.<name>``: it calls the typed methods of ``areal_sdk.plugin_host.PluginHost``.

Hooks are grouped by phase:

1. Status: ``areal_plugin_status``.
2. Registration of named components: ``areal_inference_backends``, ``areal_train_backends``,
   ``areal_weight_sync_methods``, ``areal_tool_call_parsers``, ``areal_reward_functions``,
   ``areal_metric_sinks``, ``areal_adapters``.
3. Routing: ``areal_install_routing``, ``areal_remove_routing``.
4. Episode lifecycle: ``areal_episode_started``, ``areal_turn_recorded``,
   ``areal_episode_ended``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from areal_sdk.tracing import EpisodeContext
    from areal_sdk.trajectory import Episode, Turn

PROJECT_NAME = "areal_sdk"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class PluginStatus:
    """Whether a plugin can be used here, and if not, how to fix it."""

    usable: bool
    kind: str = "plugin"
    reason: str = ""
    extra: str | None = None  # the `pip install "areal-sdk[EXTRA]"` that makes it usable
    details: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GatewayRoute:
    """Where routed calls go while a rollout runs: the gateway's root URL.

    Adapters read the episode key from ``areal_sdk.current_episode()`` at call time, so one
    route serves every episode in the process.
    """

    base_url: str  # e.g. http://127.0.0.1:8321 (no /v1)
    # Off (the default), adapters switch off their framework's own exporters (traces sent
    # to a vendor) while routing is installed: ``agent.framework_telemetry`` turns them on.
    framework_telemetry: bool = False

    @property
    def openai_base_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url.rstrip("/")


@dataclass(frozen=True)
class AdapterInfo:
    """An agent-framework adapter: its name and the Python modules it needs."""

    name: str
    framework: str
    requires: tuple[str, ...]
    extra: str


# -- 1. status -------------------------------------------------------------------------------


@hookspec(firstresult=True)
def areal_plugin_status() -> PluginStatus | None:
    """Say whether this plugin is usable in this environment.

    Called by ``areal-sdk plugins`` and before a plugin's components are used. It must not
    import the plugin's framework eagerly: check with ``importlib.util.find_spec``. Return
    ``None`` for "usable, nothing to report". Only the plugin's own implementation is
    called (the host asks each plugin separately).
    """


# -- 2. registration -------------------------------------------------------------------------


@hookspec
def areal_inference_backends() -> Mapping[str, Callable[..., Any]]:
    """Register inference backends by name (``inference.backend`` in config).

    Called once when the host first resolves a backend. Returns ``{name: factory}``, where
    ``factory(config: areal_sdk.config.Config)`` returns an
    ``areal_sdk.inference.InferenceBackend``. A name registered twice is an error.
    """


@hookspec
def areal_train_backends() -> Mapping[str, Callable[..., Any]]:
    """Register train backends by name (``train.backend`` in config).

    Returns ``{name: factory}``; ``factory(config)`` returns a train backend with
    ``forward_logprobs``, ``train_step``, ``state_for_sync``, ``save`` and ``load``.
    """


@hookspec
def areal_weight_sync_methods() -> Mapping[str, Callable[..., Any]]:
    """Register trainer-to-engine weight-sync methods by name (``weights.method``).

    Returns ``{name: factory}``; ``factory(config)`` returns an object whose
    ``push(state, version)`` moves weights into the inference backend.
    """


@hookspec
def areal_tool_call_parsers() -> Mapping[str, Callable[[str], Any]]:
    """Register tool-call parsers by name (``inference.tool_parser``).

    Returns ``{name: parser}``; ``parser(text)`` splits a completion into plain content and
    tool calls (a ``tools`` keyword, if the parser has one, gets the request's tools). The
    gateway picks one by config or by the model's chat template. Optional attributes:
    ``parser.live_cut(text) -> int`` (how much of a partial completion is surely content,
    for streaming) and ``parser.split_reasoning(text) -> Reasoning`` (the model's own
    reasoning markup, in place of ``<think>``).
    """


@hookspec
def areal_reward_functions() -> Mapping[str, Callable[..., float]]:
    """Register reward functions by name, usable as ``agent.reward`` in config.

    Returns ``{name: fn}``; ``fn(completion: str, task: dict) -> float``.
    """


@hookspec
def areal_metric_sinks() -> Mapping[str, Callable[..., Any]]:
    """Register metric sinks by name (``run.metric_sinks``).

    Called when a run starts (it fails there, naming the sink, if one is missing). Returns
    ``{name: factory}``; ``factory(run_dir: pathlib.Path, **options)`` (the options from
    ``run.metric_sink_options.<name>``) returns an object with
    ``log(step: int, metrics: dict[str, float])`` (steps count from 1) and ``close()``, and
    optionally ``drop_after(step)`` (a resumed run logs the later steps again),
    ``log_config(config)``, ``log_eval(step, metrics)`` and ``log_trajectories(step, rows)``:
    see ``areal_sdk.metrics.MetricSink``.
    """


@hookspec
def areal_adapters() -> list[AdapterInfo]:
    """Declare the agent-framework adapters this plugin provides.

    Returns a list of ``AdapterInfo``; ``areal-sdk plugins`` reports each, with the extra
    that installs its framework when the framework is missing.
    """


# -- 3. routing ------------------------------------------------------------------------------


@hookspec
def areal_install_routing(route: GatewayRoute) -> None:
    """Start routing this framework's model calls to the gateway.

    Called by the rollout controller before it runs any agent, once per process. From then
    on, a call made inside an episode by a client left at its defaults (or pointed at the
    gateway) goes to ``route`` with the episode's key; a client pointed elsewhere, and any
    call outside an episode, is untouched. Must be idempotent.
    """


@hookspec
def areal_remove_routing() -> None:
    """Undo ``areal_install_routing``. Called when the rollout controller stops."""


# -- 4. episode lifecycle --------------------------------------------------------------------


@hookspec
def areal_episode_started(episode: EpisodeContext) -> None:
    """An episode has opened: the traced agent function is about to run.

    Adapters use it to attach framework-level tracing (callbacks, trace processors).
    """


@hookspec
def areal_turn_recorded(episode_id: str, turn: Turn) -> None:
    """The gateway stored one turn of ``episode_id``. Observers only: do not mutate."""


@hookspec
def areal_episode_ended(episode: Episode) -> None:
    """An episode is final and stored (status, reward and turns set). Observers only."""
