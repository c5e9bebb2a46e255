"""Split a model's completion text into reasoning, plain content and tool calls.

Parsers are plain functions ``parser(text) -> ParsedCompletion``, registered by name through
the ``areal_tool_call_parsers`` hook (the built-ins come from ``areal_sdk.gateway.plugin``);
``default_parser_name`` picks one by the markers a chat template writes. A parser may take a
``tools`` keyword (the request's tools, to type arguments by their schemas) and carry
``live_cut(text) -> int`` (how much of a partial completion is surely content, so streaming
can show it) and ``split_reasoning(text) -> Reasoning`` (its own reasoning markup, in place
of ``<think>``). Several calls in one completion are parallel calls.

- ``hermes``: the ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` family used by
  Qwen2.5/Qwen3, Hermes and many ChatML fine-tunes.
- ``llama3_json`` (``llama.py``), ``mistral``, ``deepseek_v3`` (``deepseek.py``),
  ``qwen3_coder`` and ``harmony`` (gpt-oss): one module each.
- ``json``: a fallback for models without tool markers: the whole completion (or a fenced
  ```json block) is one call object ``{"name", "arguments"}`` or a list of them.

>>> parse_hermes('Sure.<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
ParsedCompletion(content='Sure.', tool_calls=[ParsedToolCall(name='add', arguments='{"a": 1}')])
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from areal_sdk.gateway.tool_parsers.base import (
    ParsedCompletion,
    ParsedToolCall,
    Reasoning,
    ToolCallParser,
    call_from_obj,
    marker_cut,
)
from areal_sdk.gateway.tool_parsers.deepseek import parse_deepseek_v3
from areal_sdk.gateway.tool_parsers.harmony import parse_harmony
from areal_sdk.gateway.tool_parsers.llama import parse_llama3_json
from areal_sdk.gateway.tool_parsers.mistral import parse_mistral
from areal_sdk.gateway.tool_parsers.qwen3_coder import parse_qwen3_coder

if TYPE_CHECKING:
    from areal_sdk.gateway.conversation import Tool

__all__ = [
    "BUILTIN_PARSERS",
    "ParsedCompletion",
    "ParsedToolCall",
    "Reasoning",
    "ToolCallParser",
    "default_parser_name",
    "parse_completion",
    "parse_hermes",
    "parse_json",
    "reasoning_of",
    "split_reasoning",
]

log = logging.getLogger("areal_sdk.gateway")

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_JSON_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


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
            call = call_from_obj(json.loads(match.group(1)))
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
    return marker_cut(text, "<tool_call>")


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
        calls = [call_from_obj(o) for o in (obj if isinstance(obj, list) else [obj])]
        if calls and all(c is not None for c in calls):
            return ParsedCompletion(content=rest, tool_calls=[c for c in calls if c is not None])
    return ParsedCompletion(content=text)


def _json_live_cut(text: str) -> int:
    if text.lstrip()[:1] in ("", "{", "["):  # the whole completion may be a call
        return 0
    return marker_cut(text, "```")


parse_json.live_cut = _json_live_cut  # type: ignore[attr-defined]


BUILTIN_PARSERS: dict[str, ToolCallParser] = {
    "hermes": parse_hermes,
    "json": parse_json,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "deepseek_v3": parse_deepseek_v3,
    "qwen3_coder": parse_qwen3_coder,
    "harmony": parse_harmony,
}

# (marker in the chat template, parser), most specific first: Qwen3-Coder's template also
# speaks <tool_call>, and gpt-oss's and DeepSeek's name no other family's markers.
_TEMPLATE_MARKERS = (
    ("<|channel|>", "harmony"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>", "llama3_json"),
)


def default_parser_name(chat_template: str | None) -> str:
    """The parser that fits a chat template, by the tool-call markers it writes; ``json``
    when it has none of them."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return "json"


def _takes_tools(parser: ToolCallParser) -> bool:
    try:
        return "tools" in inspect.signature(parser).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the plain ``parser(text)``
        return False


def parse_completion(
    parser: ToolCallParser, text: str, tools: Sequence[Tool] = ()
) -> ParsedCompletion:
    """Run a parser on a completion; a parser with a ``tools`` parameter gets the request's
    tools (to type arguments by their JSON schemas). A parser that raises leaves the whole
    completion as content, so a model's odd output never fails the call."""
    try:
        if _takes_tools(parser):
            return parser(text, tools=list(tools))
        return parser(text)
    except Exception:
        log.warning("tool-call parser %r failed; the completion is kept as text", parser)
        return ParsedCompletion(content=text)


def split_reasoning(text: str, *, opened: bool = False) -> Reasoning:
    """Separate a ``<think>...</think>`` block from the answer.

    A template may open ``<think>`` inside the generation prompt (Qwen3, DeepSeek-R1): with
    ``opened`` (the prompt ended in ``<think>``) a closing tag alone marks everything before it
    as reasoning, and a completion cut off before ``</think>`` is all reasoning. Without it, a
    stray ``</think>`` is text, as the live stream shows it.

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
    if start < 0 and not opened:
        return Reasoning(reasoning=None, content=text)
    before = head[:start] if start >= 0 else ""
    reasoning = head[start + len("<think>") :] if start >= 0 else head
    content = (before + text[end + len("</think>") :]).strip()
    return Reasoning(reasoning=reasoning.strip(), content=content)


def reasoning_of(parser: ToolCallParser, text: str, *, opened: bool = False) -> Reasoning:
    """Reasoning apart from the rest: by the parser's own ``split_reasoning(text)`` where it
    has one (gpt-oss's channels), else by ``<think>`` tags."""
    own = getattr(parser, "split_reasoning", None)
    return own(text) if callable(own) else split_reasoning(text, opened=opened)
