"""Adapter for the openai Python SDK (``OpenAI`` / ``AsyncOpenAI``, every API it calls).

Inside an episode, a client left at its defaults (``https://api.openai.com/v1``, or the
address ``OPENAI_BASE_URL`` gives) or pointed at the gateway sends its calls to the
gateway's ``/v1`` with the episode key as its API key: chat completions, responses and
completions, streamed or not, ``with_raw_response`` included, since the patch sits where the
SDK builds each HTTP request (openai 3 on httpx2 and the httpx-based majors before it alike).
Clients given another ``base_url=`` in code, and every call outside an episode, are
untouched. While routing is installed, a routable client built with no key at all (no
``api_key``, no ``OPENAI_API_KEY``) gets the episode key, or outside an episode a placeholder,
instead of failing to construct: agents that build ``OpenAI()`` at import time load in a
training environment without a vendor key. Child processes started inside an episode get
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from it (``EpisodeContext.env()``).
"""

from __future__ import annotations

from areal_sdk.plugins import _routing

from areal_sdk.hookspecs import AdapterInfo, GatewayRoute, PluginStatus, hookimpl
from areal_sdk.plugin_host import status_for_modules

NAME = "openai"
EXTRA = "openai"
REQUIRES = ("openai",)


@hookimpl
def areal_plugin_status() -> PluginStatus:
    return status_for_modules(REQUIRES, extra=EXTRA, kind="adapter")


@hookimpl
def areal_adapters() -> list[AdapterInfo]:
    return [AdapterInfo(name=NAME, framework="OpenAI Python SDK", requires=REQUIRES, extra=EXTRA)]


@hookimpl
def areal_install_routing(route: GatewayRoute) -> None:
    _routing.route_openai(NAME, route)


@hookimpl
def areal_remove_routing() -> None:
    _routing.unroute_openai(NAME)
