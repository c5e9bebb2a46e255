"""Fixtures for the adapter tests: two recorder servers (the "gateway" and some other API),
a rollout scope whose episodes point at the gateway recorder, and a plugin host loaded from
the real entry points with routing installed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from areal_sdk.hookspecs import GatewayRoute
from areal_sdk.plugin_host import PluginHost
from areal_sdk.tracing import EpisodeContext, RolloutScope
from areal_sdk.trajectory import Episode
from tests.plugins.recorder import Recorder

# Env names any adapter reads; tests start from none of them set.
ROUTING_ENV = (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_BASE_URL",
    "OPENAI_COMPATIBILITY_API_KEY",
    "OPENAI_COMPATIBILITY_API_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_URL",
    "ANTHROPIC_AUTH_TOKEN",
    "AREAL_SDK_DISABLE_PLUGINS",
)


class Blocked(Exception):
    """Raised by an HTTP request hook: the request was built, and not sent anywhere."""


class RequestLog:
    """An httpx event hook that records where each request goes, and stops any that would
    leave this machine (the vendor APIs), so "untouched" is checked without a network."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.headers: list[dict[str, str]] = []

    def __call__(self, request: Any) -> None:
        self.urls.append(str(request.url))
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if request.url.host != "127.0.0.1":
            raise Blocked(str(request.url))

    async def async_hook(self, request: Any) -> None:
        self(request)


class GatewayScope(RolloutScope):
    """Episodes whose gateway is ``base_url`` and whose key is ``key-<episode id>``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.episodes: list[Episode] = []

    def open_episode(self, task: Any, name: str) -> EpisodeContext:
        task_id = str(task.get("id")) if isinstance(task, dict) and "id" in task else "t"
        episode = Episode(task_id=task_id, metadata={"agent": name})
        return EpisodeContext(episode, name, base_url=self.base_url, api_key=f"key-{episode.id}")

    def close_episode(self, ctx: EpisodeContext) -> None:
        self.episodes.append(ctx.episode)
        if ctx.episode.error is not None:  # surface the agent's own error in the test
            raise AssertionError(ctx.episode.metadata.get("traceback", ctx.episode.error))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROUTING_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def _servers() -> Iterator[tuple[Recorder, Recorder]]:
    gateway, other = Recorder("gateway").start(), Recorder("other").start()
    yield gateway, other
    gateway.stop()
    other.stop()


@pytest.fixture
def gateway(_servers: tuple[Recorder, Recorder]) -> Recorder:
    _servers[0].clear()
    return _servers[0]


@pytest.fixture
def other(_servers: tuple[Recorder, Recorder]) -> Recorder:
    _servers[1].clear()
    return _servers[1]


@pytest.fixture
def other_server(other: Recorder) -> Recorder:
    """The second recorder under a name that reads well beside a real gateway."""
    return other


@pytest.fixture
def scope(gateway: Recorder) -> GatewayScope:
    return GatewayScope(gateway.url)


@pytest.fixture
def host(gateway: Recorder) -> Iterator[PluginHost]:
    """A host loaded from the installed entry points, routing to the gateway recorder."""
    host = PluginHost()
    host.install_routing(GatewayRoute(gateway.url))
    try:
        yield host
    finally:
        host.remove_routing()


@pytest.fixture
def request_log() -> RequestLog:
    return RequestLog()


def subprocess_env(ctx: EpisodeContext) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ROUTING_ENV}
    env.update(ctx.env())
    return env
