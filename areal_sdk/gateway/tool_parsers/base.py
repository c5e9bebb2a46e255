"""What every tool-call parser shares: its result types and small text helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    """One call as the model wrote it; ``arguments`` is a JSON object serialised as text."""

    name: str
    arguments: str


@dataclass
class ParsedCompletion:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass
class Reasoning:
    reasoning: str | None
    content: str


ToolCallParser = Callable[..., ParsedCompletion]

_DECODER = json.JSONDecoder()


def partial_suffix(text: str, *markers: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def first_of(text: str, *markers: str) -> int:
    """Where the first of ``markers`` starts in ``text``, or -1."""
    found = [p for p in (text.find(m) for m in markers) if p >= 0]
    return min(found) if found else -1


def marker_cut(text: str, *markers: str) -> int:
    """A ``live_cut`` for calls that start at a marker: up to the first one (or its start)."""
    pos = first_of(text, *markers)
    return pos if pos >= 0 else len(text) - partial_suffix(text, *markers)


def arguments_json(args: Any) -> str | None:
    """Arguments as JSON object text; a JSON string holding an object counts, anything else
    is None (not a call)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def call_from_obj(obj: Any) -> ParsedToolCall | None:
    """A call from a decoded ``{"name", "arguments" | "parameters"}`` object, or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else ParsedToolCall(name=name, arguments=args)


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values that ``text`` holds one after another (whitespace and any of
    ``separators`` between them), or None when anything else is there."""
    values: list[Any] = []
    pos, end = 0, len(text)
    while True:
        while pos < end and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == end:
            return values
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)


def json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
