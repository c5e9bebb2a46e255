"""Adapter for LangChain chat models (``ChatOpenAI``, ``ChatAnthropic``) and LangGraph graphs.

Routing: ``ChatOpenAI`` and ``ChatAnthropic`` call the openai and anthropic SDKs, always
through ``client.with_raw_response.create(...)``; the SDK patch re-aims those requests where
they are built, so the raw-response wrapper, streaming and ``bind_tools`` all work unchanged.
A chat model left at its defaults (no ``base_url`` in code: the SDK's URL or one from
``OPENAI_API_BASE`` / ``OPENAI_BASE_URL`` / ``ANTHROPIC_API_URL`` / ``ANTHROPIC_BASE_URL``)
goes to the gateway inside an episode; one given another URL in code does not.
LangGraph nodes call these same chat models, so graphs route with no extra step. While
routing is installed, a routable ``ChatOpenAI`` built with no key at all gets the episode key
(or a placeholder outside an episode) instead of building no sync client.

Structure: a callback handler is injected into every LangChain callback manager (through
``langchain_core``'s configure hook, no change to the user's code). When a chat model
starts inside an episode it records the LangChain run id, parent run id, run name, tags,
LangGraph node and step, the tools bound to the model, and the tools that ran since the
previous model call; the SDK patch sends that as the ``x-areal-metadata`` header
(``{"langchain": {...}}``). Token ids never come from these hooks: the gateway records them.

Telemetry: with ``LANGSMITH_TRACING`` (or ``LANGCHAIN_TRACING_V2``) set, LangChain sends
every run, prompts and outputs included, to LangSmith. While routing is installed that is
switched off (``langsmith.configure(enabled=False)``, and the same variables set to
``false`` for child processes) unless the route allows framework telemetry
(``agent.framework_telemetry``) or the agent's code configured LangSmith itself.
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from areal_sdk.plugins import _routing

from areal_sdk.hookspecs import AdapterInfo, GatewayRoute, PluginStatus, hookimpl
from areal_sdk.plugin_host import status_for_modules
from areal_sdk.tracing import current_episode

if TYPE_CHECKING:
    from areal_sdk.trajectory import Episode

NAME = "langchain"
EXTRA = "langchain"
REQUIRES = ("langchain_core",)
CHAT_MODEL_PACKAGES = {"langchain_openai": "openai", "langchain_anthropic": "anthropic"}
_MAX_TRACKED_EPISODES = 4096

# The chat-model run in progress in this context (set by the handler, read by the SDK patch).
_current_run: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "areal_langchain_run", default=None
)


class _ToolLog:
    """Names of the tools each episode ran since its last model call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_episode: OrderedDict[str, list[str]] = OrderedDict()

    def add(self, episode_id: str, tool: str) -> None:
        with self._lock:
            self._by_episode.setdefault(episode_id, []).append(tool)
            self._by_episode.move_to_end(episode_id)
            while len(self._by_episode) > _MAX_TRACKED_EPISODES:  # episodes never ended
                self._by_episode.popitem(last=False)

    def take(self, episode_id: str) -> list[str]:
        with self._lock:
            return self._by_episode.pop(episode_id, [])

    def forget(self, episode_id: str) -> None:
        with self._lock:
            self._by_episode.pop(episode_id, None)


_tools = _ToolLog()


def _tool_names(invocation_params: Mapping[str, Any] | None) -> list[str]:
    names = []
    for tool in (invocation_params or {}).get("tools") or []:
        if isinstance(tool, Mapping):
            fn = tool.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else tool.get("name")
            if name:
                names.append(str(name))
    return names


def _run_name(serialized: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> str | None:
    if kwargs.get("name"):
        return str(kwargs["name"])
    if serialized:
        if serialized.get("name"):
            return str(serialized["name"])
        ids = serialized.get("id")
        if isinstance(ids, list) and ids:
            return str(ids[-1])
    return None


_handler: Any = None
_handler_var: contextvars.ContextVar[Any] | None = None
_hook_entry: tuple[Any, ...] | None = None
_lock = threading.Lock()


def _make_handler() -> Any:
    from langchain_core.callbacks import BaseCallbackHandler

    class AReaLCallbackHandler(BaseCallbackHandler):
        """Turns LangChain run events into turn metadata for the current episode."""

        # Inline: run in the caller's context, so the context variable it sets is the one
        # the model's HTTP request is built in (async handlers would run in a copy).
        run_inline = True
        raise_error = False

        def on_chat_model_start(
            self,
            serialized: dict[str, Any],
            messages: list[list[Any]],
            *,
            run_id: Any,
            parent_run_id: Any = None,
            tags: list[str] | None = None,
            metadata: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            ctx = current_episode()
            if ctx is None:
                return
            meta = metadata or {}
            record: dict[str, Any] = {
                "run_id": str(run_id),
                "parent_run_id": str(parent_run_id) if parent_run_id else None,
                "name": _run_name(serialized, kwargs),
                "tags": list(tags or []),
                "tools_bound": _tool_names(kwargs.get("invocation_params")),
                "tools_since_last_call": _tools.take(ctx.id),
            }
            for key in ("langgraph_node", "langgraph_step", "thread_id"):
                if meta.get(key) is not None:
                    record[key] = meta[key]
            _current_run.set({k: v for k, v in record.items() if v not in (None, [])})

        def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None:
            _current_run.set(None)

        def on_llm_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None:
            _current_run.set(None)

        def on_tool_start(
            self, serialized: dict[str, Any], input_str: str, *, run_id: Any, **kwargs: Any
        ) -> None:
            ctx = current_episode()
            name = _run_name(serialized, kwargs)
            if ctx is not None and name:
                _tools.add(ctx.id, name)

    return AReaLCallbackHandler()


def _install_callbacks() -> None:
    """Put our handler into every callback manager LangChain configures (idempotent)."""
    global _handler, _handler_var, _hook_entry
    from langchain_core.tracers import context as lc_context

    with _lock:
        if _hook_entry is not None:
            return
        _handler = _make_handler()
        # The hook reads a ContextVar; its default makes the handler visible in every
        # thread and task. The handler itself does nothing outside an episode.
        _handler_var = contextvars.ContextVar("areal_langchain_handler", default=_handler)
        lc_context.register_configure_hook(_handler_var, inheritable=True)
        _hook_entry = lc_context._configure_hooks[-1]


def _remove_callbacks() -> None:
    global _handler, _handler_var, _hook_entry
    from langchain_core.tracers import context as lc_context

    with _lock:
        if _hook_entry is None:
            return
        # langchain_core has no unregister; its hook list is a plain list we appended to.
        if _hook_entry in lc_context._configure_hooks:
            lc_context._configure_hooks.remove(_hook_entry)
        _handler = _handler_var = _hook_entry = None


_chat_openai_init: Any = None


def _patch_chat_openai_key() -> None:
    """Let ``ChatOpenAI()`` be built with no ``OPENAI_API_KEY`` while routing is installed.

    ``ChatOpenAI`` without a key builds no sync client at all (``invoke`` then fails); a
    routable one (no base URL in code, or the gateway's) is given the key of
    ``_routing.key_for_routed_client``. A model with a key or another URL is unchanged.
    """
    global _chat_openai_init
    if importlib.util.find_spec("langchain_openai") is None:
        return
    from langchain_openai import ChatOpenAI

    with _lock:
        if _chat_openai_init is not None:
            return
        original = ChatOpenAI.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            has_key = any(kwargs.get(k) is not None for k in ("api_key", "openai_api_key"))
            if not has_key and not os.environ.get("OPENAI_API_KEY"):
                base = kwargs.get("base_url") or kwargs.get("openai_api_base")
                key = _routing.key_for_routed_client()
                if key is not None and _routing.routable_in_code(base):
                    kwargs["api_key"] = key
            original(self, *args, **kwargs)

        ChatOpenAI.__init__ = __init__  # type: ignore[method-assign]
        _chat_openai_init = original


def _unpatch_chat_openai_key() -> None:
    global _chat_openai_init
    with _lock:
        if _chat_openai_init is None:
            return
        from langchain_openai import ChatOpenAI

        ChatOpenAI.__init__ = _chat_openai_init  # type: ignore[method-assign]
        _chat_openai_init = None


_LANGSMITH_OFF = {"LANGSMITH_TRACING": "false", "LANGSMITH_TRACING_V2": "false"}
_langsmith_silenced = False


def _silence_langsmith() -> None:
    """Switch LangSmith tracing off process-wide, unless the agent's code configured it."""
    global _langsmith_silenced
    if importlib.util.find_spec("langsmith") is None:
        return
    import langsmith

    _routing.ENV_SWITCHES.set(NAME, _LANGSMITH_OFF)
    try:  # langsmith.configure(enabled=...) in the agent's code is the user's own choice
        from langsmith._internal import _context

        configured = getattr(_context, "_GLOBAL_TRACING_ENABLED", None)
    except ImportError:
        configured = None
    if configured is None and hasattr(langsmith, "configure"):
        langsmith.configure(enabled=False)  # outranks the environment, in every thread
        _langsmith_silenced = True


def _restore_langsmith() -> None:
    global _langsmith_silenced
    _routing.ENV_SWITCHES.restore(NAME)
    if _langsmith_silenced:
        import langsmith

        langsmith.configure(enabled=None)  # back to what the environment says
        _langsmith_silenced = False


def _metadata() -> dict[str, Any] | None:
    return _current_run.get()


def _available_sdks() -> list[str]:
    return [
        sdk
        for pkg, sdk in CHAT_MODEL_PACKAGES.items()
        if importlib.util.find_spec(pkg) is not None and importlib.util.find_spec(sdk) is not None
    ]


@hookimpl
def areal_plugin_status() -> PluginStatus:
    status = status_for_modules(REQUIRES, extra=EXTRA, kind="adapter")
    if not status.usable:
        return status
    found = [pkg for pkg in CHAT_MODEL_PACKAGES if importlib.util.find_spec(pkg) is not None]
    if not found:
        return PluginStatus(
            False,
            kind="adapter",
            reason=f"no chat-model package (langchain-openai, langchain-anthropic): "
            f'pip install "areal-sdk[{EXTRA}]"',
            extra=EXTRA,
        )
    return PluginStatus(True, kind="adapter", details={"chat_models": ", ".join(found)})


@hookimpl
def areal_adapters() -> list[AdapterInfo]:
    return [
        AdapterInfo(
            name=NAME,
            framework="LangChain / LangGraph",
            requires=(*REQUIRES, *CHAT_MODEL_PACKAGES),
            extra=EXTRA,
        )
    ]


# The chat models' async SDK clients share one cached HTTP client per process (per settings).
_HTTP_CLIENTS = (
    _routing.PerLoopClients(
        "langchain_openai.chat_models.base",
        "_get_default_async_httpx_client",
        "langchain_openai.chat_models._client_utils:_build_async_httpx_client",
    ),
    _routing.PerLoopClients("langchain_anthropic.chat_models", "_get_default_async_httpx_client"),
)


@hookimpl
def areal_install_routing(route: GatewayRoute) -> None:
    sdks = _available_sdks()
    if "openai" in sdks:
        _routing.route_openai(NAME, route)
    if "anthropic" in sdks:
        _routing.route_anthropic(NAME, route)
    _install_callbacks()
    _patch_chat_openai_key()
    if not route.framework_telemetry and not _langsmith_silenced:
        _silence_langsmith()
    for sdk, clients in zip(CHAT_MODEL_PACKAGES.values(), _HTTP_CLIENTS, strict=True):
        if sdk in sdks:
            clients.install()
    _routing.register_metadata_provider(NAME, _metadata)


@hookimpl
def areal_remove_routing() -> None:
    _routing.unregister_metadata_provider(NAME)
    _remove_callbacks()
    _unpatch_chat_openai_key()
    _restore_langsmith()
    for clients in _HTTP_CLIENTS:
        clients.remove()
    _routing.unroute_openai(NAME)
    _routing.unroute_anthropic(NAME)


@hookimpl
def areal_episode_ended(episode: Episode) -> None:
    _tools.forget(episode.id)
