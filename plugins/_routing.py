"""Routing shared by the framework adapters: send an episode's SDK calls to the gateway.

The openai and anthropic SDKs (every framework adapter sits on one of them) build each HTTP
request in ``BaseClient._build_request(options)``. That method exists, with the same
signature, in the httpx2-based majors (openai 3, anthropic 2) and the httpx-based ones
before them, so patching it covers both HTTP stacks without touching transports.

At request time the patch asks :func:`episode_target`; outside an episode it calls the
original method and nothing changes. Inside one, a client left at its SDK's default base URL
(or already pointed at the gateway) gets its request re-aimed at the gateway root, with the
episode key as the API key and the turn metadata of the active framework hooks in the
``x-areal-metadata`` header. A client pointed at any other URL (an LLM judge on another API)
is untouched, and so is a client built with ``default_headers={"x-areal-route": "off"}``.

Nothing on the client object changes, so a client built before the episode, or shared by
episodes running in parallel, routes each call by the episode of the caller.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.tracing import current_episode

METADATA_HEADER = "x-areal-metadata"
ROUTE_HEADER = "x-areal-route"  # "off" on a client keeps it on its own base URL
_MAX_METADATA_BYTES = 4096  # headers stay well under common 8 KiB proxy limits

_lock = threading.RLock()
_route: GatewayRoute | None = None
_route_owners: set[str] = set()
_metadata_providers: dict[str, Callable[[], Mapping[str, Any] | None]] = {}


@dataclass(frozen=True)
class Target:
    """Where the calls of the current episode go."""

    root: str  # gateway root, no trailing slash and no /v1
    api_key: str


def set_route(owner: str, route: GatewayRoute) -> None:
    """Record the process-wide gateway route on behalf of adapter ``owner``."""
    global _route
    with _lock:
        _route = route
        _route_owners.add(owner)


def clear_route(owner: str) -> None:
    """Forget ``owner``'s claim on the route; the route goes when no adapter holds it."""
    global _route
    with _lock:
        _route_owners.discard(owner)
        if not _route_owners:
            _route = None


def current_route() -> GatewayRoute | None:
    return _route


def episode_target() -> Target | None:
    """The gateway and key of the caller's episode, or ``None`` (then nothing is routed)."""
    ctx = current_episode()
    if ctx is None or not ctx.api_key:
        return None
    root = ctx.base_url or (_route.base_url if _route is not None else None)
    if not root:
        return None
    return Target(root.rstrip("/"), ctx.api_key)


def _norm(url: object) -> str:
    return str(url).rstrip("/")


def is_gateway_url(url: object, target: Target | None = None) -> bool:
    """Whether ``url`` points at the gateway of ``target`` or of the installed route."""
    text = _norm(url)
    roots = [t for t in (target.root if target else None, _route and _route.base_url) if t]
    return any(text == _norm(r) or text.startswith(_norm(r) + "/") for r in roots)


def should_route(base_url: object, default_url: str, target: Target) -> bool:
    """A client is routed when it is at its SDK's default URL or already at the gateway."""
    return _norm(base_url) == _norm(default_url) or is_gateway_url(base_url, target)


# -- turn metadata -------------------------------------------------------------------------


def register_metadata_provider(name: str, provider: Callable[[], Mapping[str, Any] | None]) -> None:
    """Add a source of turn metadata (framework hooks), read when a request is built."""
    with _lock:
        _metadata_providers[name] = provider


def unregister_metadata_provider(name: str) -> None:
    with _lock:
        _metadata_providers.pop(name, None)


def current_metadata() -> dict[str, Any]:
    """Everything the active framework hooks know about the call being made now."""
    out: dict[str, Any] = {}
    for name, provider in list(_metadata_providers.items()):
        try:
            value = provider()
        except Exception:  # metadata is best effort; it must never fail a model call
            continue
        if value:
            out[name] = dict(value)
    return out


def metadata_header_value(metadata: Mapping[str, Any]) -> str | None:
    """``metadata`` as compact ASCII JSON for the header, or ``None`` when empty/too large."""
    if not metadata:
        return None
    text = json.dumps(metadata, separators=(",", ":"), default=str, sort_keys=True)
    return text if len(text) <= _MAX_METADATA_BYTES else None


# -- the SDK patch -------------------------------------------------------------------------


@dataclass(frozen=True)
class SdkSpec:
    """How one Stainless-generated SDK is routed."""

    module: str  # "openai" or "anthropic"
    default_url: str  # the SDK's built-in base URL
    api_root: Callable[[str], str]  # gateway root -> this SDK's base URL at the gateway
    auth_headers: Callable[[str], dict[str, str]]  # episode key -> headers


def _headers_of(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _route_off(client: Any, options: Any) -> bool:
    for headers in (
        _headers_of(getattr(client, "_custom_headers", None)),
        _headers_of(options.headers),
    ):
        for key, value in headers.items():
            if key.lower() == ROUTE_HEADER and str(value).lower() == "off":
                return True
    return False


def _copy_options(options: Any) -> Any:
    copy = getattr(options, "model_copy", None) or options.copy  # pydantic 2 / pydantic 1
    return copy()


class SdkPatch:
    """A reference-counted patch of one SDK's ``BaseClient._build_request``.

    Several adapters need the same SDK routed (LangChain's ``ChatOpenAI`` and the Agents
    SDK both sit on openai), so each one acquires the patch under its own name and the
    original method comes back when the last one releases it.
    """

    def __init__(self, spec: SdkSpec) -> None:
        self.spec = spec
        self._owners: set[str] = set()
        self._original: Callable[..., Any] | None = None
        self._base_client: Any = None

    @property
    def active(self) -> bool:
        return self._original is not None

    def acquire(self, owner: str) -> None:
        with _lock:
            self._owners.add(owner)
            if self._original is None:
                base = importlib.import_module(f"{self.spec.module}._base_client").BaseClient
                self._base_client = base
                self._original = base._build_request
                base._build_request = self._make_wrapper(self._original)

    def release(self, owner: str) -> None:
        with _lock:
            self._owners.discard(owner)
            if not self._owners and self._original is not None:
                self._base_client._build_request = self._original
                self._original = None

    def _make_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        spec = self.spec

        def _build_request(client: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
            target = episode_target()
            if (
                target is None
                or not should_route(client.base_url, spec.default_url, target)
                or _route_off(client, options)
            ):
                return original(client, options, *args, **kwargs)
            url = str(options.url)
            if "://" in url:  # an absolute URL: re-aim it only if it is under the client's base
                base = _norm(client.base_url)
                if not url.startswith(base + "/"):
                    return original(client, options, *args, **kwargs)
                url = url[len(base) :]
            routed = _copy_options(options)
            routed.url = spec.api_root(target.root) + "/" + url.lstrip("/")
            headers = _headers_of(options.headers)
            headers.update(spec.auth_headers(target.api_key))
            meta = metadata_header_value(current_metadata())
            if meta is not None:
                headers[METADATA_HEADER] = meta
            routed.headers = headers
            return original(client, routed, *args, **kwargs)

        _build_request.__wrapped__ = original  # type: ignore[attr-defined]
        return _build_request


OPENAI = SdkPatch(
    SdkSpec(
        module="openai",
        default_url="https://api.openai.com/v1",
        api_root=lambda root: root + "/v1",
        auth_headers=lambda key: {"Authorization": f"Bearer {key}"},
    )
)
ANTHROPIC = SdkPatch(
    SdkSpec(
        module="anthropic",
        default_url="https://api.anthropic.com",
        api_root=lambda root: root,
        auth_headers=lambda key: {"X-Api-Key": key, "Authorization": f"Bearer {key}"},
    )
)


PLACEHOLDER_KEY = "areal-sdk-no-key"


def key_for_routed_client() -> str | None:
    """The key to build a routable client with when the user has none, or ``None``.

    Inside an episode: the episode key. Outside one, while routing is installed: a
    placeholder, so an agent module that builds ``OpenAI()`` at import time still loads in
    a training environment with no vendor key. The placeholder is never sent to the
    gateway (routed calls carry the episode key); sent to the vendor, it fails as any
    wrong key does.
    """
    target = episode_target()
    if target is not None:
        return target.api_key
    return PLACEHOLDER_KEY if _route is not None else None


class OpenAIKeyFill:
    """Let ``OpenAI()`` be built while a rollout runs when no ``OPENAI_API_KEY`` is set.

    The openai SDK refuses to construct a client without a key, before any request exists.
    A client that will be routed (no base URL, or the gateway's) and has no key of its own
    gets :func:`key_for_routed_client`; a client with a key or another URL is unchanged.
    """

    def __init__(self) -> None:
        self._owners: set[str] = set()
        self._originals: dict[type, Callable[..., Any]] = {}

    def acquire(self, owner: str) -> None:
        with _lock:
            self._owners.add(owner)
            if self._originals:
                return
            import openai

            for cls in (openai.OpenAI, openai.AsyncOpenAI):
                self._originals[cls] = cls.__init__
                cls.__init__ = self._make_init(cls.__init__)  # type: ignore[method-assign]

    def release(self, owner: str) -> None:
        with _lock:
            self._owners.discard(owner)
            if not self._owners:
                for cls, init in self._originals.items():
                    cls.__init__ = init  # type: ignore[method-assign]
                self._originals.clear()

    @staticmethod
    def _make_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("api_key") is None and not os.environ.get("OPENAI_API_KEY"):
                base = kwargs.get("base_url") or os.environ.get("OPENAI_BASE_URL")
                key = key_for_routed_client()
                if key is not None and (base is None or is_gateway_url(base, episode_target())):
                    kwargs["api_key"] = key
            original(self, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        return __init__


OPENAI_KEY_FILL = OpenAIKeyFill()


def route_openai(owner: str, route: GatewayRoute) -> None:
    """Route the openai SDK on behalf of ``owner`` (idempotent)."""
    set_route(owner, route)
    OPENAI.acquire(owner)
    OPENAI_KEY_FILL.acquire(owner)


def unroute_openai(owner: str) -> None:
    OPENAI_KEY_FILL.release(owner)
    OPENAI.release(owner)
    clear_route(owner)


def route_anthropic(owner: str, route: GatewayRoute) -> None:
    """Route the anthropic SDK on behalf of ``owner`` (idempotent)."""
    set_route(owner, route)
    ANTHROPIC.acquire(owner)


def unroute_anthropic(owner: str) -> None:
    ANTHROPIC.release(owner)
    clear_route(owner)


class PerLoopClients:
    """While routing is installed, one async HTTP client per event loop where a framework
    keeps one per process.

    The Agents SDK and LangChain's chat models share a cached ``AsyncClient`` among all the
    SDK clients they build. Its kept-alive connections belong to the event loop that opened
    them, so an episode on another loop (``asyncio.run`` per call, ``run_sync`` in threads)
    would pick up a connection of a closed or foreign loop: "Event loop is closed", or a
    hang. ``module.name`` is the framework's getter; called inside a running loop it now
    returns a client of that loop, built by the first of ``builders`` (``"module:attr"``)
    that exists, or by the getter's own ``__wrapped__`` when it is an ``lru_cache``, with the
    same arguments. Outside a loop
    the framework's own cache answers. A loop's clients go when the loop does.
    """

    def __init__(self, module: str, name: str, *builders: str) -> None:
        self.module, self.name, self.builders = module, name, builders
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._owner: Any = None
        self._original: Callable[..., Any] | None = None

    def _build_function(self, original: Callable[..., Any]) -> Callable[..., Any] | None:
        for builder in self.builders:
            module, _, attr = builder.partition(":")
            try:
                found = getattr(importlib.import_module(module), attr, None)
            except ImportError:
                continue
            if found is not None:
                return found
        return None if self.builders else getattr(original, "__wrapped__", None)

    def install(self) -> bool:
        """Patch the getter; False (and nothing changed) where this version has none."""
        with _lock:
            if self._original is not None:
                return True
            try:
                owner = importlib.import_module(self.module)
            except ImportError:
                return False
            original = getattr(owner, self.name, None)
            build = self._build_function(original) if callable(original) else None
            if original is None or build is None:
                return False

            def per_loop(*args: Any, **kwargs: Any) -> Any:
                try:
                    loop = asyncio.get_running_loop()
                    key = (args, tuple(sorted(kwargs.items())))
                    hash(key)
                except (RuntimeError, TypeError):  # no loop, or arguments no cache could key
                    return original(*args, **kwargs)
                with _lock:
                    clients = self._clients.setdefault(loop, {})
                    if key not in clients:
                        clients[key] = build(*args, **kwargs)
                    return clients[key]

            per_loop.__wrapped__ = original  # type: ignore[attr-defined]
            self._owner, self._original = owner, original
            setattr(owner, self.name, per_loop)
            return True

    def remove(self) -> None:
        with _lock:
            if self._original is not None:
                setattr(self._owner, self.name, self._original)
                self._owner = self._original = None
