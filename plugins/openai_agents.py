"""Adapter for the OpenAI Agents SDK (``agents``: ``Agent``, ``Runner``, model providers).

Routing: every model the Agents SDK ships talks through an ``AsyncOpenAI`` client, so the
openai SDK patch covers them all. The default ``OpenAIProvider`` builds its client with
no ``base_url`` (or ``OPENAI_BASE_URL``) and uses the Responses API, which the gateway
serves at ``/v1/responses``; ``set_default_openai_api("chat_completions")``,
``OpenAIChatCompletionsModel(openai_client=AsyncOpenAI())`` and ``set_default_openai_client``
with a default client route the same way, to ``/v1/chat/completions``. A provider or client
given another ``base_url`` is left alone. The provider's cached client may be built before
any episode: the patch decides per request, by the caller's episode.

Structure: a trace processor keeps the open spans of every trace. When a model request is
built inside an episode it walks from the current span up to the trace and sends the agent
name, the span chain, the workflow name, group id and trace id, and the tools (function
spans) that ran since the previous model call, as ``x-areal-metadata``
(``{"openai_agents": {...}}``). The processor stays registered after routing is removed
(the SDK has no way to unregister one) but then does nothing.

Trace export: the SDK's default exporter sends every trace to OpenAI's tracing backend (or,
without ``OPENAI_API_KEY``, logs "skipping trace export" for each batch). A trace started
inside an episode holds the episode's prompts and replies, which leave the machine only
through an exporter the user turns on; the exporter drops those traces, and exports the
others as before.
"""

from __future__ import annotations

import threading
from typing import Any

from areal_sdk.plugins import _routing

from areal_sdk.hookspecs import AdapterInfo, GatewayRoute, PluginStatus, hookimpl
from areal_sdk.plugin_host import status_for_modules
from areal_sdk.tracing import current_episode

NAME = "openai_agents"
EXTRA = "openai-agents"
REQUIRES = ("agents",)
_MAX_OPEN = 65536  # spans of runs that never ended (a crashed run) must not grow forever


class _SpanBook:
    """Open spans by id and the tools each trace ran since its last model call."""

    def __init__(self) -> None:
        self.active = False
        self._lock = threading.Lock()
        self.spans: dict[str, tuple[str, str | None, str | None]] = {}  # id -> type, name, parent
        self.tools: dict[str, list[str]] = {}
        # Traces started inside an episode; kept after routing is removed, as the SDK
        # exports batches later (at the latest when the process exits).
        self.episode_traces: dict[str, None] = {}

    def start_trace(self, trace_id: str) -> None:
        with self._lock:
            if len(self.episode_traces) >= _MAX_OPEN:
                self.episode_traces.pop(next(iter(self.episode_traces)))
            self.episode_traces[trace_id] = None

    def exportable(self, items: list[Any]) -> list[Any]:
        with self._lock:
            return [i for i in items if getattr(i, "trace_id", None) not in self.episode_traces]

    def start(self, span: Any) -> None:
        data = span.span_data
        entry = (str(data.type), getattr(data, "name", None), span.parent_id)
        with self._lock:
            if len(self.spans) >= _MAX_OPEN:
                self.spans.clear()
            self.spans[span.span_id] = entry

    def end(self, span: Any) -> None:
        data = span.span_data
        with self._lock:
            self.spans.pop(span.span_id, None)
            name = getattr(data, "name", None)
            if data.type == "function" and name:
                self.tools.setdefault(span.trace_id, []).append(str(name))

    def end_trace(self, trace_id: str) -> None:
        with self._lock:
            self.tools.pop(trace_id, None)

    def chain(self, span_id: str | None) -> list[tuple[str, str | None]]:
        out = []
        with self._lock:
            while span_id is not None and span_id in self.spans and len(out) < 32:
                kind, name, parent = self.spans[span_id]
                out.append((kind, name))
                span_id = parent
        return out

    def take_tools(self, trace_id: str) -> list[str]:
        with self._lock:
            return self.tools.pop(trace_id, [])


_book = _SpanBook()
# The default provider's AsyncOpenAI clients share one module-level HTTP client.
_http_clients = _routing.PerLoopClients(
    "agents.models.openai_provider",
    "shared_http_client",
    "openai:DefaultAsyncHttpx2Client",  # openai 3
    "openai:DefaultAsyncHttpxClient",  # openai 2
)
_processor: Any = None
_lock = threading.Lock()


def _make_processor() -> Any:
    from agents.tracing import TracingProcessor

    class AReaLTraceProcessor(TracingProcessor):
        """Keeps span names so model requests can say which agent made them."""

        def on_trace_start(self, trace: Any) -> None:
            if _book.active and current_episode() is not None:
                _book.start_trace(trace.trace_id)

        def on_trace_end(self, trace: Any) -> None:
            if _book.active:
                _book.end_trace(trace.trace_id)

        def on_span_start(self, span: Any) -> None:
            if _book.active:
                _book.start(span)

        def on_span_end(self, span: Any) -> None:
            if _book.active:
                _book.end(span)

        def shutdown(self) -> None:
            return None

        def force_flush(self) -> None:
            return None

    return AReaLTraceProcessor()


def _keep_episode_traces_home() -> None:
    """Make the SDK's default exporter leave out the traces of episodes (once per process)."""
    from agents.tracing.processors import default_exporter

    exporter = default_exporter()
    export_all = exporter.export
    if getattr(export_all, "keeps_episode_traces", False):
        return

    def export(items: list[Any]) -> None:
        kept = _book.exportable(items)
        if kept:
            export_all(kept)

    export.keeps_episode_traces = True  # type: ignore[attr-defined]
    exporter.export = export  # the SDK's batch processor calls an instance's own export


def _metadata() -> dict[str, Any] | None:
    if not _book.active:
        return None
    from agents.tracing import get_current_span, get_current_trace

    trace = get_current_trace()
    span = get_current_span()
    if trace is None and span is None:
        return None
    chain = _book.chain(getattr(span, "span_id", None))
    out: dict[str, Any] = {}
    if trace is not None:
        out["trace_id"] = trace.trace_id
        out["workflow_name"] = getattr(trace, "name", None)
        out["group_id"] = getattr(trace, "group_id", None)
        tools = _book.take_tools(trace.trace_id)
        if tools:
            out["tools_since_last_call"] = tools
    agent = next((name for kind, name in chain if kind == "agent"), None)
    if agent:
        out["agent"] = agent
    if chain:
        out["spans"] = [f"{kind}:{name}" if name else kind for kind, name in reversed(chain)]
    return {k: v for k, v in out.items() if v is not None}


@hookimpl
def areal_plugin_status() -> PluginStatus:
    return status_for_modules(REQUIRES, extra=EXTRA, kind="adapter")


@hookimpl
def areal_adapters() -> list[AdapterInfo]:
    return [AdapterInfo(name=NAME, framework="OpenAI Agents SDK", requires=REQUIRES, extra=EXTRA)]


@hookimpl
def areal_install_routing(route: GatewayRoute) -> None:
    global _processor
    _routing.route_openai(NAME, route)
    with _lock:
        if _processor is None:
            from agents.tracing import add_trace_processor

            _processor = _make_processor()
            add_trace_processor(_processor)
            _keep_episode_traces_home()
        _book.active = True
        _http_clients.install()
    _routing.register_metadata_provider(NAME, _metadata)


@hookimpl
def areal_remove_routing() -> None:
    _routing.unregister_metadata_provider(NAME)
    with _lock:
        _book.active = False
        _book.spans.clear()
        _book.tools.clear()
        _http_clients.remove()
    _routing.unroute_openai(NAME)
