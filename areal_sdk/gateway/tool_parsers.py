"""Split a model's completion text into reasoning, plain content and tool calls.

Parsers are plain functions ``parser(text) -> ParsedCompletion``, registered by name through
the ``areal_tool_call_parsers`` hook (the built-ins come from ``areal_sdk.gateway.plugin``):

- ``hermes``: the ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` family used by
  Qwen2.5/Qwen3, Hermes and many ChatML fine-tunes. Several blocks are parallel calls.
- ``json``: a fallback for models without tool markers: the whole completion (or a fenced
  ```json block) is one call object ``{"name", "arguments"}`` or a list of them.

>>> parse_hermes('Sure.<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
ParsedCompletion(content='Sure.', tool_calls=[ParsedToolCall(name='add', arguments='{"a": 1}')])
"""

from __future__ import annotations

import json
import re
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


ToolCallParser = Callable[[str], ParsedCompletion]

# A parser may also carry ``live_cut(text) -> int``: how much of a partial completion is
# surely content (never part of a call), so streaming can show it before the end. Content
# stays a prefix of the text (leading whitespace kept), so what was shown stays true.


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_JSON_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def _call_from_obj(obj: Any) -> ParsedToolCall | None:
    """A call from a decoded JSON object, or None when it does not look like one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models write the arguments as a JSON string; keep it if it decodes to an object.
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> ParsedCompletion:
    """``<tool_call>{json}</tool_call>`` blocks become calls; text outside them is content.

    A block whose JSON does not decode stays in the content as written, so nothing the model
    produced is lost.
    """
    if "<tool_call>" not in text:
        return ParsedCompletion(content=text)
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_BLOCK.finditer(text):
        try:
            call = _call_from_obj(json.loads(match.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return ParsedCompletion(content="".join(kept).rstrip() if calls else text, tool_calls=calls)


def _hermes_live_cut(text: str) -> int:
    pos = text.find("<tool_call>")
    return pos if pos >= 0 else len(text) - _partial_suffix(text, "<tool_call>")


parse_hermes.live_cut = _hermes_live_cut  # type: ignore[attr-defined]


def parse_json(text: str) -> ParsedCompletion:
    """The whole completion (or a fenced JSON block) is a call object or a list of them."""
    # (candidate JSON, the content left when it is a call)
    candidates = [(text.strip(), "")]
    fence = _JSON_FENCE.search(text)
    if fence:
        candidates.append((fence.group(1), (text[: fence.start()] + text[fence.end() :]).rstrip()))
    for candidate, rest in candidates:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        calls = [_call_from_obj(o) for o in (obj if isinstance(obj, list) else [obj])]
        if calls and all(c is not None for c in calls):
            return ParsedCompletion(content=rest, tool_calls=[c for c in calls if c is not None])
    return ParsedCompletion(content=text)


def _json_live_cut(text: str) -> int:
    if text.lstrip()[:1] in ("", "{", "["):  # the whole completion may be a call
        return 0
    pos = text.find("```")
    return pos if pos >= 0 else len(text) - _partial_suffix(text, "```")


parse_json.live_cut = _json_live_cut  # type: ignore[attr-defined]


BUILTIN_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "json": parse_json}


def default_parser_name(chat_template: str | None) -> str:
    """The parser that fits a chat template: ``hermes`` when it speaks ``<tool_call>``."""
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"
    return "json"


@dataclass
class Reasoning:
    reasoning: str | None
    content: str


def split_reasoning(text: str, *, opened: bool = False) -> Reasoning:
    """Separate a ``<think>...</think>`` block from the answer.

    A template may open ``<think>`` inside the generation prompt (Qwen3, DeepSeek-R1), so a
    closing tag alone also marks everything before it as reasoning; with ``opened`` (the
    prompt ended in ``<think>``) a completion cut off before ``</think>`` is all reasoning.

    >>> split_reasoning("<think>2+2 is 4</think>\\n\\nIt is 4.")
    Reasoning(reasoning='2+2 is 4', content='It is 4.')
    """
    end = text.find("</think>")
    if end < 0:
        if opened:
            return Reasoning(reasoning=text.strip(), content="")
        if text.lstrip().startswith("<think>"):  # cut off while still thinking
            return Reasoning(reasoning=text.lstrip()[len("<think>") :].strip(), content="")
        return Reasoning(reasoning=None, content=text)
    head = text[:end]
    start = head.find("<think>")
    before = head[:start] if start >= 0 else ""
    reasoning = head[start + len("<think>") :] if start >= 0 else head
    content = (before + text[end + len("</think>") :]).strip()
    return Reasoning(reasoning=reasoning.strip(), content=content)
