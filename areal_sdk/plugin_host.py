"""The plugin host: discovery through entry points, and a typed facade over the hooks.

Loading is lazy: ``import areal_sdk`` imports no plugin. A plugin that fails to import, or
whose framework is missing, is recorded as unusable with the reason; it never breaks the host.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import logging
import os
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from areal_sdk import hookspecs
from areal_sdk.hookspecs import AdapterInfo, GatewayRoute, PluginStatus

if TYPE_CHECKING:
    from areal_sdk.tracing import EpisodeContext
    from areal_sdk.trajectory import Episode, Turn

ENTRY_POINT_GROUP = "areal_sdk"
DISABLE_ENV = "AREAL_SDK_DISABLE_PLUGINS"
log = logging.getLogger(__name__)


class PluginError(RuntimeError):
    """A component was asked for that no usable plugin provides, or two provide it."""


@dataclass(frozen=True)
class PluginRecord:
    """One plugin as the host sees it."""

    name: str
    source: str  # "areal-sdk 0.1.0 (built-in)", "my-dist 1.2", "registered in code"
    status: PluginStatus
    loaded: bool
    kinds: tuple[str, ...] = ()
    # kind -> the names this plugin registers: {"reward": ("exact_match",), "adapter": ...}
    provides: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def _disabled_names() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def _source_of(ep: md.EntryPoint) -> str:
    dist = ep.dist
    if dist is None:
        return "unknown distribution"
    label = f"{dist.metadata['Name']} {dist.version}"
    return f"{label} (built-in)" if dist.metadata["Name"] == "areal-sdk" else label


_REGISTRY_HOOKS = {
    "inference_backend": "areal_inference_backends",
    "train_backend": "areal_train_backends",
    "weight_sync": "areal_weight_sync_methods",
    "tool_parser": "areal_tool_call_parsers",
    "reward": "areal_reward_functions",
    "metric_sink": "areal_metric_sinks",
}


class PluginHost:
    """Typed access to every hook. One per process is usual (``get_host()``)."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._records: dict[str, PluginRecord] = {}
        self._failed: dict[str, PluginRecord] = {}
        if load_entry_points:
            self._load_entry_points()

    # -- discovery -------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        disabled = _disabled_names()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._records or ep.name in self._failed:
                continue
            source = _source_of(ep)
            if ep.name in disabled:
                self._failed[ep.name] = PluginRecord(
                    ep.name,
                    source,
                    PluginStatus(False, reason=f"disabled by {DISABLE_ENV}"),
                    loaded=False,
                )
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin is reported, never fatal
                reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self._failed[ep.name] = PluginRecord(
                    ep.name, source, PluginStatus(False, reason=f"import failed: {reason}"), False
                )
                continue
            self.register(plugin, ep.name, source=source)

    def register(self, plugin: object, name: str, *, source: str = "registered in code") -> None:
        """Register a plugin object or module under ``name``."""
        if name in _disabled_names():
            self._failed[name] = PluginRecord(
                name, source, PluginStatus(False, reason=f"disabled by {DISABLE_ENV}"), False
            )
            return
        self.pm.register(plugin, name=name)
        self._records[name] = PluginRecord(name, source, self._status_of(name), True)

    def unregister(self, name: str) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self._records.pop(name, None)

    def _only(self, hook_name: str, plugin_name: str) -> Any:
        others = [p for n, p in self.pm.list_name_plugin() if n != plugin_name and p is not None]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)

    def _status_of(self, name: str) -> PluginStatus:
        try:
            status = self._only("areal_plugin_status", name)()
        except Exception as exc:
            return PluginStatus(False, reason=f"status check failed: {exc}")
        return status if status is not None else PluginStatus(True)

    def _is_usable(self, name: str) -> bool:
        record = self._records.get(name)
        return record is not None and record.status.usable

    # -- status ----------------------------------------------------------------------------

    def plugins(self) -> list[PluginRecord]:
        """Every plugin seen, loaded or not, with the components it registers by kind."""
        out = []
        for name, record in self._records.items():
            provides: dict[str, tuple[str, ...]] = {}
            adapters = [
                info.name for infos in self._only("areal_adapters", name)() for info in infos
            ]
            if adapters:
                provides["adapter"] = tuple(adapters)
            for kind, hook in _REGISTRY_HOOKS.items():
                names = [key for result in self._only(hook, name)() for key in result]
                if names:
                    provides[kind] = tuple(sorted(names))
            out.append(
                PluginRecord(
                    record.name,
                    record.source,
                    record.status,
                    record.loaded,
                    tuple(provides) or ("hooks",),
                    provides,
                )
            )
        out.extend(self._failed.values())
        return sorted(out, key=lambda r: r.name)

    # -- registration hooks ----------------------------------------------------------------

    def _registry(self, kind: str) -> dict[str, Callable[..., Any]]:
        hook_name = _REGISTRY_HOOKS[kind]
        merged: dict[str, Callable[..., Any]] = {}
        owner: dict[str, str] = {}
        for plugin_name in self._records:
            if not self._is_usable(plugin_name):
                continue
            for result in self._only(hook_name, plugin_name)():
                for key, value in result.items():
                    if key in merged:
                        raise PluginError(
                            f"{kind} {key!r} is registered by both {owner[key]!r} and "
                            f"{plugin_name!r}; disable one with {DISABLE_ENV}"
                        )
                    merged[key] = value
                    owner[key] = plugin_name
        return merged

    def _resolve(self, kind: str, name: str) -> Callable[..., Any]:
        registry = self._registry(kind)
        if name in registry:
            return registry[name]
        for record in self.plugins():
            if not record.status.usable and name in record.provides.get(kind, ()):
                raise PluginError(
                    f"{kind.replace('_', ' ')} {name!r} (plugin {record.name!r}) is unusable "
                    f"here: {record.status.reason}"
                )
        known = ", ".join(sorted(registry)) or "none"
        unusable = [f"{r.name} ({r.status.reason})" for r in self.plugins() if not r.status.usable]
        hint = f"; unusable plugins: {'; '.join(unusable)}" if unusable else ""
        raise PluginError(f"no {kind.replace('_', ' ')} named {name!r}; known: {known}{hint}")

    def inference_backends(self) -> dict[str, Callable[..., Any]]:
        return self._registry("inference_backend")

    def inference_backend(self, name: str) -> Callable[..., Any]:
        return self._resolve("inference_backend", name)

    def train_backends(self) -> dict[str, Callable[..., Any]]:
        return self._registry("train_backend")

    def train_backend(self, name: str) -> Callable[..., Any]:
        return self._resolve("train_backend", name)

    def weight_sync_methods(self) -> dict[str, Callable[..., Any]]:
        return self._registry("weight_sync")

    def weight_sync_method(self, name: str) -> Callable[..., Any]:
        return self._resolve("weight_sync", name)

    def tool_call_parsers(self) -> dict[str, Callable[[str], Any]]:
        return self._registry("tool_parser")

    def tool_call_parser(self, name: str) -> Callable[[str], Any]:
        return self._resolve("tool_parser", name)

    def reward_functions(self) -> dict[str, Callable[..., float]]:
        return self._registry("reward")

    def reward_function(self, name: str) -> Callable[..., float]:
        return self._resolve("reward", name)

    def metric_sinks(self) -> dict[str, Callable[..., Any]]:
        return self._registry("metric_sink")

    def metric_sink(self, name: str) -> Callable[..., Any]:
        return self._resolve("metric_sink", name)

    def adapters(self) -> list[tuple[AdapterInfo, PluginRecord]]:
        """Every declared adapter with the record of the plugin that declares it."""
        out: list[tuple[AdapterInfo, PluginRecord]] = []
        for record in self._records.values():
            for infos in self._only("areal_adapters", record.name)():
                out.extend((info, record) for info in infos)
        return out

    # -- routing and lifecycle -------------------------------------------------------------

    def _usable_caller(self, hook_name: str) -> Any:
        unusable = [self.pm.get_plugin(n) for n in self._records if not self._is_usable(n)]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=[p for p in unusable if p])

    def install_routing(self, route: GatewayRoute) -> None:
        """Route every usable adapter's framework to ``route``.

        An adapter that fails to install (its framework broken, or shadowed by a user module of
        the same name) is marked unusable with the reason and logged; the others keep working,
        so a framework the agent never uses cannot stop the run."""
        for name in [n for n in self._records if self._is_usable(n)]:
            try:
                self._only("areal_install_routing", name)(route=route)
            except Exception as exc:
                reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                log.warning("plugin %r could not install its routing: %s", name, reason)
                with contextlib.suppress(Exception):  # undo what it installed before failing
                    self._only("areal_remove_routing", name)()
                record = self._records[name]
                status = PluginStatus(
                    False, kind=record.status.kind, reason=f"routing failed: {reason}"
                )
                self._records[name] = PluginRecord(name, record.source, status, record.loaded)

    def remove_routing(self) -> None:
        self._usable_caller("areal_remove_routing")()

    def episode_started(self, episode: EpisodeContext) -> None:
        self._usable_caller("areal_episode_started")(episode=episode)

    def turn_recorded(self, episode_id: str, turn: Turn) -> None:
        self._usable_caller("areal_turn_recorded")(episode_id=episode_id, turn=turn)

    def episode_ended(self, episode: Episode) -> None:
        self._usable_caller("areal_episode_ended")(episode=episode)


_host: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide host, created (and entry points loaded) on first use."""
    global _host
    if _host is None:
        _host = PluginHost()
    return _host


def reset_host() -> None:
    """Forget the process-wide host (tests, or after changing the disable list)."""
    global _host
    _host = None


# `Requires-Dist: langchain-openai<2,>=1; extra == "langchain"`: the name and the extra.
_REQUIREMENT = re.compile(r'^\s*([A-Za-z0-9][A-Za-z0-9._-]*).*;.*extra\s*==\s*"([^"]+)"')
_AGGREGATE_EXTRAS = frozenset({"all", "dev"})


def extra_for_module(module: str, host: PluginHost | None = None) -> str | None:
    """The areal-sdk extra that installs the top-level package of ``module``, or None.

    Adapters declare their import names (``agents`` for openai-agents, ``camel`` for
    camel-ai); other packages are matched by distribution name (``langchain-openai`` ->
    ``langchain_openai``) against the extras in areal-sdk's own metadata.
    """
    top = module.partition(".")[0]
    for info, _ in (host or get_host()).adapters():
        if top in {name.partition(".")[0] for name in info.requires}:
            return info.extra
    try:
        requirements = md.requires("areal-sdk") or []
    except md.PackageNotFoundError:
        return None
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match is None or match[2] in _AGGREGATE_EXTRAS:
            continue
        if re.sub(r"[-.]", "_", match[1]).lower() == top.lower():
            return match[2]
    return None


def status_for_modules(
    modules: Mapping[str, str] | tuple[str, ...], *, extra: str, kind: str
) -> PluginStatus:
    """A ``PluginStatus`` that is usable when every module can be found.

    ``modules`` names import names (``("langchain_openai",)``) or maps them to pip names.
    """
    import importlib.util

    names = list(modules)
    missing = [m for m in names if importlib.util.find_spec(m) is None]
    if missing:
        return PluginStatus(
            False,
            kind=kind,
            reason=f'missing {", ".join(missing)}: pip install "areal-sdk[{extra}]"',
            extra=extra,
        )
    return PluginStatus(True, kind=kind)
