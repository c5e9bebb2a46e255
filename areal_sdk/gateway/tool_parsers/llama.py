"""Llama 3.x JSON tool calls (``llama3_json``).

Llama 3.1-3.3 answer a tool request with the call as the whole message, a JSON object
``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``; several calls are
written one after another, separated by ``;``. Text before ``<|python_tag|>`` is content.

>>> parse_llama3_json('{"name": "add", "parameters": {"a": 1}}').tool_calls
[ParsedToolCall(name='add', arguments='{"a": 1}')]
"""

from __future__ import annotations

from areal_sdk.gateway.tool_parsers.base import (
    ParsedCompletion,
    call_from_obj,
    json_values,
    marker_cut,
)

PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedCompletion:
    """Calls from a completion that is (after ``<|python_tag|>``) JSON call objects only.

    Anything else, such as JSON that is not a call or text after the calls, stays content as
    written.
    """
    pos = text.find(PYTHON_TAG)
    if pos >= 0:
        head, body = text[:pos], text[pos + len(PYTHON_TAG) :]
    elif text.lstrip().startswith("{"):
        head, body = "", text
    else:
        return ParsedCompletion(content=text)
    values = json_values(body, separators=";,")
    calls = [call_from_obj(v) for v in values or []]
    if not calls or any(c is None for c in calls):
        return ParsedCompletion(content=text)
    return ParsedCompletion(content=head.rstrip(), tool_calls=[c for c in calls if c])


def _live_cut(text: str) -> int:
    if PYTHON_TAG not in text and text.lstrip()[:1] in ("", "{"):
        return 0  # the whole completion may be a call
    return marker_cut(text, PYTHON_TAG)


parse_llama3_json.live_cut = _live_cut  # type: ignore[attr-defined]
