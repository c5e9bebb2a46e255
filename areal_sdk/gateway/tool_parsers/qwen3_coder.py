"""Qwen3-Coder's XML tool calls (``qwen3_coder``).

``<tool_call>\\n<function=name>\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``,
one block per call. Values are written bare, so each is typed by the tool's JSON schema:
``integer``, ``number``, ``boolean``, ``null``, ``object`` and ``array`` values are decoded,
``string`` ones kept as written; a parameter the schema does not name is decoded when it
is JSON and kept as text otherwise. Text before the first call is content.

>>> parse_qwen3_coder('<tool_call>\\n<function=f>\\n<parameter=n>\\n2\\n</parameter>\\n</function>\\n</tool_call>').tool_calls
[ParsedToolCall(name='f', arguments='{"n": 2}')]
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from areal_sdk.gateway.tool_parsers.base import (
    ParsedCompletion,
    ParsedToolCall,
    first_of,
    marker_cut,
)

if TYPE_CHECKING:
    from areal_sdk.gateway.conversation import Tool

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_WRAPPERS = re.compile(r"</?tool_call>")
_NOT_DECODED = object()


def _decoded(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return _NOT_DECODED


def typed_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A bare parameter value as its schema's type; text when it does not fit the type."""
    kind = (schema or {}).get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if kind else set()
    if kinds == {"string"}:
        return raw
    value = _decoded(raw.strip())
    if value is _NOT_DECODED and "boolean" in kinds:
        value = _decoded(raw.strip().lower())  # True / False
    if value is _NOT_DECODED:
        return raw
    if not kinds:
        return value
    fits = {
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }
    return value if any(fits.get(k, False) for k in kinds) else raw


def _schemas(tools: Sequence[Tool]) -> dict[str, dict[str, Any]]:
    return {t.name: (t.parameters or {}).get("properties") or {} for t in tools}


def parse_qwen3_coder(text: str, tools: Sequence[Tool] = ()) -> ParsedCompletion:
    """Calls from ``<function=...>`` blocks (inside ``<tool_call>``, which the model may
    leave out), typed by ``tools``; if a block is unfinished or holds stray text, the whole
    completion stays content as written."""
    start = first_of(text, "<tool_call>", "<function=")
    if start < 0:
        return ParsedCompletion(content=text)
    block = text[start:]
    schemas = _schemas(tools)
    calls = []
    for match in _FUNCTION.finditer(block):
        name = match.group(1).strip()
        props = schemas.get(name, {})
        body = match.group(2)
        if _PARAMETER.sub("", body).strip():
            return ParsedCompletion(content=text)
        args = {
            p.strip(): typed_value(v, props.get(p.strip())) for p, v in _PARAMETER.findall(body)
        }
        calls.append(ParsedToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))
    if not calls or _WRAPPERS.sub("", _FUNCTION.sub("", block)).strip():
        return ParsedCompletion(content=text)
    return ParsedCompletion(content=text[:start].rstrip(), tool_calls=calls)


def _live_cut(text: str) -> int:
    return marker_cut(text, "<tool_call>", "<function=")


parse_qwen3_coder.live_cut = _live_cut  # type: ignore[attr-defined]
