"""Mistral's ``[TOOL_CALLS]`` (``mistral``), in both of its forms.

- v0.3 tokenizers (Mistral 7B v0.3, Nemo, Small 3.1): ``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]``, a JSON list of calls.
- v11+ tokenizers (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}``, once per
  call, with an optional ``[CALL_ID]id`` after the name.

Text before the first ``[TOOL_CALLS]`` is content.

>>> [c.name for c in parse_mistral('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]neg[ARGS]{}').tool_calls]
['add', 'neg']
"""

from __future__ import annotations

from areal_sdk.gateway.tool_parsers.base import (
    ParsedCompletion,
    ParsedToolCall,
    arguments_json,
    call_from_obj,
    json_prefix,
    json_values,
    marker_cut,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _calls_in(segment: str) -> list[ParsedToolCall] | None:
    """The calls after one ``[TOOL_CALLS]``, or None when they do not all decode."""
    if segment.lstrip()[:1] in ("[", "{"):  # the JSON form
        values = json_values(segment)
        if values is None:
            return None
        objs = [o for v in values for o in (v if isinstance(v, list) else [v])]
        calls = [call_from_obj(o) for o in objs]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
    calls = []
    rest = segment
    while rest.strip():  # the name[ARGS]{...} form
        name, sep, after = rest.partition(ARGS)
        name = name.partition(CALL_ID)[0].strip()
        decoded = json_prefix(after) if sep else None
        if not name or decoded is None:
            return None
        args = arguments_json(decoded[0])
        if args is None:
            return None
        calls.append(ParsedToolCall(name=name, arguments=args))
        rest = after[decoded[1] :]
    return calls or None


def parse_mistral(text: str) -> ParsedCompletion:
    """Calls after ``[TOOL_CALLS]``; if any of them does not decode, the whole completion
    stays content as written."""
    pos = text.find(TOOL_CALLS)
    if pos < 0:
        return ParsedCompletion(content=text)
    calls: list[ParsedToolCall] = []
    for segment in text[pos + len(TOOL_CALLS) :].split(TOOL_CALLS):
        found = _calls_in(segment)
        if found is None:
            return ParsedCompletion(content=text)
        calls += found
    return ParsedCompletion(content=text[:pos].rstrip(), tool_calls=calls)


def _live_cut(text: str) -> int:
    return marker_cut(text, TOOL_CALLS)


parse_mistral.live_cut = _live_cut  # type: ignore[attr-defined]
