"""Adapter for the anthropic Python SDK (``Anthropic`` / ``AsyncAnthropic``).

Inside an episode, a client left at its defaults (``https://api.anthropic.com``, or the
address ``ANTHROPIC_BASE_URL`` gives) or pointed at the gateway sends its Messages calls to
the gateway root with the episode key in ``X-Api-Key`` (and as a bearer token, for clients
built with ``auth_token``). A client given another ``base_url=`` in code is untouched, as is
every call outside an episode. Child processes started inside an episode get
``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` from it (``EpisodeContext.env()``).
"""

from __future__ import annotations

from areal_sdk.plugins import _routing

from areal_sdk.hookspecs import AdapterInfo, GatewayRoute, PluginStatus, hookimpl
from areal_sdk.plugin_host import status_for_modules

NAME = "anthropic"
EXTRA = "anthropic"
REQUIRES = ("anthropic",)


@hookimpl
def areal_plugin_status() -> PluginStatus:
    return status_for_modules(REQUIRES, extra=EXTRA, kind="adapter")


@hookimpl
def areal_adapters() -> list[AdapterInfo]:
    return [
        AdapterInfo(name=NAME, framework="Anthropic Python SDK", requires=REQUIRES, extra=EXTRA)
    ]


@hookimpl
def areal_install_routing(route: GatewayRoute) -> None:
    _routing.route_anthropic(NAME, route)


@hookimpl
def areal_remove_routing() -> None:
    _routing.unroute_anthropic(NAME)
