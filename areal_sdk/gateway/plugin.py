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
    """``hermes``, ``llama3_json``, ``mistral``, ``deepseek_v3``, ``qwen3_coder``, ``harmony``
    (gpt-oss) and ``json`` (the fallback); see ``areal_sdk.gateway.tool_parsers``."""
    return dict(BUILTIN_PARSERS)
