"""Registers the SGLang client as the inference backend ``sglang``.

Entry point (pyproject): ``sglang = "areal_sdk.backends.sglang.plugin"``. Nothing heavy is
imported here; the SGLang server itself runs in its own environment, so this plugin is
usable wherever areal-sdk is (``sglang-router``, optional, comes with the ``sglang`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from areal_sdk.hookspecs import PluginStatus, hookimpl

if TYPE_CHECKING:
    from areal_sdk.backends.sglang.backend import SGLangBackend

    from areal_sdk.config import Config


def create_backend(config: Config) -> SGLangBackend:
    """Attach to ``inference.urls`` or launch SGLang servers, per the ``inference`` section."""
    from areal_sdk.backends.sglang.backend import SGLangBackend

    return SGLangBackend.from_config(config)


@hookimpl
def areal_plugin_status() -> PluginStatus | None:
    return PluginStatus(True, kind="inference backend")


@hookimpl
def areal_inference_backends() -> Mapping[str, Callable[..., Any]]:
    return {"sglang": create_backend}
