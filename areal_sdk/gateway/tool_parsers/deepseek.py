"""DeepSeek-V3's tool calls (``deepseek_v3``), also read in DeepSeek-V3.1's shorter form.

V3, R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}
\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``. V3.1: ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}
<｜tool▁call▁end｜>``. Each ``tool▁call`` block is one call; text before the first is content.
"""

from __future__ import annotations

import json
import re

from areal_sdk.gateway.tool_parsers.base import (
    ParsedCompletion,
    ParsedToolCall,
    arguments_json,
    first_of,
    marker_cut,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)(?:" + re.escape(CALL_END) + "|$)",
    re.DOTALL,
)
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _call(head: str, body: str) -> ParsedToolCall | None:
    if head.strip() == "function":  # V3: the name on the first line, then fenced JSON
        name, _, body = body.partition("\n")
        fence = _FENCE.match(body)
        body = fence.group(1) if fence else body
    else:  # V3.1: the name before the separator
        name = head
    try:
        args = arguments_json(json.loads(body))
    except json.JSONDecodeError:
        return None
    name = name.strip()
    return ParsedToolCall(name=name, arguments=args) if name and args is not None else None


def parse_deepseek_v3(text: str) -> ParsedCompletion:
    """Calls from the ``tool▁call`` blocks; if any of them does not decode, the whole
    completion stays content as written."""
    start = first_of(text, CALLS_BEGIN, CALL_BEGIN)
    if start < 0:
        return ParsedCompletion(content=text)
    block = text[start:]
    calls = []
    for match in _CALL.finditer(block):
        call = _call(match.group(1), match.group(2))
        if call is None:
            return ParsedCompletion(content=text)
        calls.append(call)
    rest = _CALL.sub("", block).replace(CALLS_BEGIN, "").replace(CALLS_END, "").strip()
    if not calls or rest:
        return ParsedCompletion(content=text)
    return ParsedCompletion(content=text[:start].rstrip(), tool_calls=calls)


def _live_cut(text: str) -> int:
    return marker_cut(text, CALLS_BEGIN, CALL_BEGIN)


parse_deepseek_v3.live_cut = _live_cut  # type: ignore[attr-defined]
