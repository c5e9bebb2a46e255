"""The gateway's built-in tool-call parsers, registered like a third party's.

Entry point (``[project.entry-points.areal_sdk]``): ``gateway = "areal_sdk.gateway.plugin"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from areal_sdk.gateway.tool_parsers import BUILTIN_PARSERS
from areal_sdk.hookspecs import hookimpl


@hookimpl
def areal_tool_call_parsers() -> Mapping[str, Callable[[str], Any]]:
    """``hermes`` (``<tool_call>{json}</tool_call>``) and ``json`` (the fallback)."""
    return dict(BUILTIN_PARSERS)
