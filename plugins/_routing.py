"""Routing shared by the framework adapters: send an episode's SDK calls to the gateway.

The openai and anthropic SDKs (every framework adapter sits on one of them) build each HTTP
request in ``BaseClient._build_request(options)``. That method exists, with the same
signature, in the httpx2-based majors (openai 3, anthropic 2) and the httpx-based ones
before them, so patching it covers both HTTP stacks without touching transports.

At request time the patch asks :func:`episode_target`; outside an episode it calls the
original method and nothing changes. Inside one, a client left at its defaults (the SDK's
built-in base URL, or the one an environment variable such as ``OPENAI_BASE_URL`` gives) or
already pointed at the gateway gets its request re-aimed at the gateway root, with the
episode key as the API key and the turn metadata of the active framework hooks in the
``x-areal-metadata`` header. A client given any other URL in code (an LLM judge on another
API) is untouched, and so is a client built with ``default_headers={"x-areal-route": "off"}``.

Child processes started with :mod:`subprocess` (or asyncio's subprocess functions) inside an
episode inherit its routing variables (:class:`ChildProcessEnv`).

Nothing on the client object changes, so a client built before the episode, or shared by
episodes running in parallel, routes each call by the episode of the caller.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import subprocess
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.tracing import current_episode, routing_env

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


# The environment variables through which the SDKs and the frameworks on them read a base
# URL: an address found there is the user's default, routed like the SDK's built-in one.
OPENAI_URL_ENV = (
    "OPENAI_BASE_URL",  # openai SDK
    "OPENAI_API_BASE",  # LangChain's ChatOpenAI
    "OPENAI_API_BASE_URL",  # CAMEL's OPENAI platform
    "OPENAI_COMPATIBILITY_API_BASE_URL",  # CAMEL's OPENAI_COMPATIBLE_MODEL platform
)
ANTHROPIC_URL_ENV = (
    "ANTHROPIC_BASE_URL",  # anthropic SDK
    "ANTHROPIC_API_URL",  # LangChain's ChatAnthropic
)


def env_urls(names: tuple[str, ...]) -> set[str]:
    return {_norm(os.environ[n]) for n in names if os.environ.get(n, "").strip()}


def should_route(
    base_url: object, default_url: str, target: Target | None, env_names: tuple[str, ...] = ()
) -> bool:
    """A client is routed when it is at its SDK's default URL, at an address from the
    environment, or already at the gateway; one given another URL in code is not."""
    url = _norm(base_url)
    return (
        url == _norm(default_url) or url in env_urls(env_names) or is_gateway_url(base_url, target)
    )


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
    url_env: tuple[str, ...]  # environment variables that give this SDK's clients a URL
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
                or not should_route(client.base_url, spec.default_url, target, spec.url_env)
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
        url_env=OPENAI_URL_ENV,
        api_root=lambda root: root + "/v1",
        auth_headers=lambda key: {"Authorization": f"Bearer {key}"},
    )
)
ANTHROPIC = SdkPatch(
    SdkSpec(
        module="anthropic",
        default_url="https://api.anthropic.com",
        url_env=ANTHROPIC_URL_ENV,
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


def routable_in_code(url: object | None) -> bool:
    """Whether a client given ``url`` in code (``None``: none given) will be routed: it
    takes its address from the environment or the SDK's default, or names the gateway."""
    return url is None or is_gateway_url(url, episode_target())


class OpenAIKeyFill:
    """Let ``OpenAI()`` be built while a rollout runs when no ``OPENAI_API_KEY`` is set.

    The openai SDK refuses to construct a client without a key, before any request exists.
    A client that will be routed (no base URL in code, or the gateway's) and has no key of
    its own gets :func:`key_for_routed_client`; a client with a key or given another URL is
    unchanged.
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
                key = key_for_routed_client()
                if key is not None and routable_in_code(kwargs.get("base_url")):
                    kwargs["api_key"] = key
            original(self, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        return __init__


OPENAI_KEY_FILL = OpenAIKeyFill()


class ChildProcessEnv:
    """Give child processes started inside an episode the episode's routing variables.

    Episodes run concurrently in one process, so ``os.environ`` cannot carry the key.
    Instead ``subprocess.Popen`` (under ``subprocess.run``, ``check_output`` and asyncio's
    ``create_subprocess_exec`` / ``_shell``) is patched: started inside an episode, a child
    gets each variable of :func:`~areal_sdk.tracing.routing_env` unless its caller set that
    variable to a value of its own. With ``env=None`` the child's environment is this
    process's plus the episode's; with an explicit ``env``, a routing variable it lacks or
    copies unchanged from ``os.environ`` is replaced, one it sets otherwise is kept.
    ``os.system``, ``os.exec*``, ``os.posix_spawn`` and multiprocessing's spawn start
    method bypass ``Popen``: pass ``current_episode().env()`` to those yourself.
    """

    def __init__(self) -> None:
        self._owners: set[str] = set()
        self._original: Callable[..., Any] | None = None

    def acquire(self, owner: str) -> None:
        with _lock:
            self._owners.add(owner)
            if self._original is None:
                self._original = subprocess.Popen.__init__
                subprocess.Popen.__init__ = self._make_init(self._original)  # type: ignore[method-assign]

    def release(self, owner: str) -> None:
        with _lock:
            self._owners.discard(owner)
            if not self._owners and self._original is not None:
                subprocess.Popen.__init__ = self._original  # type: ignore[method-assign]
                self._original = None

    @staticmethod
    def child_env(env: Mapping[str, str] | None, target: Target) -> dict[str, str]:
        """The environment a child started with ``env`` gets inside ``target``'s episode."""
        out = dict(os.environ if env is None else env)
        for name, value in routing_env(target.root, target.api_key).items():
            if name not in out or out[name] == os.environ.get(name):
                out[name] = value
        for name, value in ENV_SWITCHES.for_children().items():
            out.setdefault(name, value)
        return out

    def _make_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            target = episode_target()
            if target is not None:
                bound = signature.bind(self, *args, **kwargs)
                bound.arguments["env"] = ChildProcessEnv.child_env(
                    bound.arguments.get("env"), target
                )
                args, kwargs = bound.args[1:], bound.kwargs
            original(self, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        return __init__


CHILD_PROCESS_ENV = ChildProcessEnv()


def route_openai(owner: str, route: GatewayRoute) -> None:
    """Route the openai SDK on behalf of ``owner`` (idempotent)."""
    set_route(owner, route)
    OPENAI.acquire(owner)
    OPENAI_KEY_FILL.acquire(owner)
    CHILD_PROCESS_ENV.acquire(f"{owner}/openai")


def unroute_openai(owner: str) -> None:
    CHILD_PROCESS_ENV.release(f"{owner}/openai")
    OPENAI_KEY_FILL.release(owner)
    OPENAI.release(owner)
    clear_route(owner)


def route_anthropic(owner: str, route: GatewayRoute) -> None:
    """Route the anthropic SDK on behalf of ``owner`` (idempotent)."""
    set_route(owner, route)
    ANTHROPIC.acquire(owner)
    CHILD_PROCESS_ENV.acquire(f"{owner}/anthropic")


def unroute_anthropic(owner: str) -> None:
    CHILD_PROCESS_ENV.release(f"{owner}/anthropic")
    ANTHROPIC.release(owner)
    clear_route(owner)


class EnvSwitches:
    """Environment variables an adapter sets while routing is installed, restored after.

    For framework switches read from the environment at use (CAMEL's ``LANGFUSE_ENABLED``)
    and for child processes, which inherit them: telemetry that is off here stays off in a
    subprocess agent too. ``children_only`` values go only into the environment of children
    started inside an episode (a switch this process must not read itself).
    """

    def __init__(self) -> None:
        self._saved: dict[str, dict[str, str | None]] = {}
        self._children: dict[str, dict[str, str]] = {}

    def set(self, owner: str, values: Mapping[str, str], *, children_only: bool = False) -> None:
        with _lock:
            if children_only:
                self._children.setdefault(owner, {}).update(values)
                return
            saved = self._saved.setdefault(owner, {})
            for name, value in values.items():
                saved.setdefault(name, os.environ.get(name))
                os.environ[name] = value

    def for_children(self) -> dict[str, str]:
        with _lock:
            return {k: v for values in self._children.values() for k, v in values.items()}

    def restore(self, owner: str) -> None:
        with _lock:
            self._children.pop(owner, None)
            for name, value in self._saved.pop(owner, {}).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


ENV_SWITCHES = EnvSwitches()


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
