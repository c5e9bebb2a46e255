"""Adapter for CAMEL (``camel-ai``): ``ChatAgent`` on ``ModelFactory`` backends.

Routing: CAMEL's ``OPENAI`` platform (also ``DEFAULT``, which is ``OPENAI`` unless
``DEFAULT_MODEL_PLATFORM_TYPE`` says otherwise) and ``OPENAI_COMPATIBLE_MODEL`` build
``openai.OpenAI`` / ``AsyncOpenAI`` clients, so the openai SDK patch routes them:

- ``OPENAI``: ``url`` or ``OPENAI_API_BASE_URL``; when neither is set the SDK default (or
  ``OPENAI_BASE_URL``) applies. Without a ``url`` in code the backend goes to the gateway
  inside an episode: an address from the environment is the user's default.
- ``OPENAI_COMPATIBLE_MODEL``: ``url`` or ``OPENAI_COMPATIBILITY_API_BASE_URL``, key from
  ``api_key`` or ``OPENAI_COMPATIBILITY_API_KEY``. Routed the same way: with no ``url`` in
  code, or one naming the gateway, it gets the episode key; a ``url`` naming another server
  is untouched.

CAMEL checks for a key when the backend is built (``OPENAI_API_KEY`` for ``OPENAI``), before
any request exists; while routing is installed, a backend that will be routed and has no key
of its own is built with the episode key (or, outside an episode, a placeholder that is never
sent to the gateway), so ``ChatAgent("...")`` works with no OpenAI account. A routed backend
built without a ``token_counter`` counts context in UTF-8 bytes instead of tiktoken (which
downloads its encoding, and is not the policy's tokenizer).

Telemetry: CAMEL traces model calls to Langfuse when ``LANGFUSE_ENABLED=true``. While
routing is installed, ``LANGFUSE_ENABLED`` and Langfuse's own ``LANGFUSE_TRACING_ENABLED``
are ``false`` (child processes inherit them) unless the route allows framework telemetry
(``agent.framework_telemetry``).

Structure: ``ChatAgent.step`` / ``astep`` run with the agent's role name, role type, agent
id and model type in context; the SDK patch sends them as ``x-areal-metadata``
(``{"camel": {...}}``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import os
import threading
from typing import Any

from areal_sdk.plugins import _routing

from areal_sdk.hookspecs import AdapterInfo, GatewayRoute, PluginStatus, hookimpl
from areal_sdk.plugin_host import status_for_modules

NAME = "camel"
EXTRA = "camel"
REQUIRES = ("camel",)

# Per routed platform: the env name CAMEL reads for the key (its URL names are in
# _routing.OPENAI_URL_ENV).
PLATFORM_KEY_ENV = {
    "openai": "OPENAI_API_KEY",
    "openai-compatible-model": "OPENAI_COMPATIBILITY_API_KEY",
}

_current_agent: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "areal_camel_agent", default=None
)
_originals: dict[str, Any] = {}
_lock = threading.Lock()


def _platform_value(platform: Any) -> str:
    return str(getattr(platform, "value", platform))


def _policy_token_counter() -> Any:
    """A token counter for backends that talk to the policy, which is no OpenAI model.

    CAMEL's default ``OpenAITokenCounter`` counts with tiktoken, which downloads its
    encoding on first use: that fails offline, and it is the wrong tokenizer for the
    policy anyway. Counting UTF-8 bytes needs nothing and bounds from above the token count
    of any byte-level BPE tokenizer, so CAMEL's context window never overflows the policy's.
    """
    from camel.utils import BaseTokenCounter

    class PolicyByteCounter(BaseTokenCounter):
        def count_tokens_from_messages(self, messages: list[Any]) -> int:
            return sum(len(json.dumps(m, default=str).encode("utf-8")) for m in messages)

        def encode(self, text: str) -> list[int]:
            return list(text.encode("utf-8"))

        def decode(self, token_ids: list[int]) -> str:
            return bytes(token_ids).decode("utf-8", errors="replace")

    return PolicyByteCounter()


def _wrap_create(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        key = _routing.key_for_routed_client()
        if key is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        key_env = PLATFORM_KEY_ENV.get(_platform_value(bound.arguments.get("model_platform")))
        if key_env is not None and bound.arguments.get("api_key") is None:
            routed = _routing.routable_in_code(bound.arguments.get("url"))
            if routed and not os.environ.get(key_env):
                bound.arguments["api_key"] = key
            if routed and bound.arguments.get("token_counter") is None:
                bound.arguments["token_counter"] = _policy_token_counter()
        return original(*bound.args, **bound.kwargs)

    return create


def _agent_record(agent: Any) -> dict[str, Any]:
    role_type = getattr(agent, "role_type", None)
    backend = getattr(agent, "model_backend", None)
    model_type = getattr(backend, "model_type", None)
    record = {
        "role_name": getattr(agent, "role_name", None),
        "role_type": _platform_value(role_type) if role_type is not None else None,
        "agent_id": getattr(agent, "agent_id", None),
        "model_type": str(model_type) if model_type is not None else None,
    }
    return {k: v for k, v in record.items() if v is not None}


def _wrap_step(original: Any) -> Any:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _current_agent.set(_agent_record(self))
        try:
            return original(self, *args, **kwargs)
        finally:
            _current_agent.reset(token)

    return step


def _wrap_astep(original: Any) -> Any:
    @functools.wraps(original)
    async def astep(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _current_agent.set(_agent_record(self))
        try:
            return await original(self, *args, **kwargs)
        finally:
            _current_agent.reset(token)

    return astep


def _patch() -> None:
    from camel.agents import ChatAgent
    from camel.models import ModelFactory

    with _lock:
        if _originals:
            return
        _originals["create"] = ModelFactory.__dict__["create"]
        _originals["step"] = ChatAgent.step
        _originals["astep"] = ChatAgent.astep
        ModelFactory.create = staticmethod(_wrap_create(ModelFactory.create))
        ChatAgent.step = _wrap_step(ChatAgent.step)
        ChatAgent.astep = _wrap_astep(ChatAgent.astep)


def _unpatch() -> None:
    with _lock:
        if not _originals:
            return
        from camel.agents import ChatAgent
        from camel.models import ModelFactory

        ModelFactory.create = _originals["create"]
        ChatAgent.step = _originals["step"]
        ChatAgent.astep = _originals["astep"]
        _originals.clear()


def _metadata() -> dict[str, Any] | None:
    return _current_agent.get()


@hookimpl
def areal_plugin_status() -> PluginStatus:
    return status_for_modules(REQUIRES, extra=EXTRA, kind="adapter")


@hookimpl
def areal_adapters() -> list[AdapterInfo]:
    return [AdapterInfo(name=NAME, framework="CAMEL", requires=REQUIRES, extra=EXTRA)]


_LANGFUSE_OFF = {"LANGFUSE_ENABLED": "false", "LANGFUSE_TRACING_ENABLED": "false"}


def _silence_langfuse() -> None:
    _routing.ENV_SWITCHES.set(NAME, _LANGFUSE_OFF)
    try:  # a backend built before now may have configured it already
        from camel.utils import configure_langfuse

        configure_langfuse(enabled=False)
    except Exception:  # no langfuse installed (CAMEL then traces nothing), or an older CAMEL
        pass


@hookimpl
def areal_install_routing(route: GatewayRoute) -> None:
    _routing.route_openai(NAME, route)
    _patch()
    if not route.framework_telemetry:
        _silence_langfuse()
    _routing.register_metadata_provider(NAME, _metadata)


@hookimpl
def areal_remove_routing() -> None:
    _routing.unregister_metadata_provider(NAME)
    _unpatch()
    _routing.ENV_SWITCHES.restore(NAME)
    _routing.unroute_openai(NAME)
