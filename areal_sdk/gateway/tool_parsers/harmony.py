"""gpt-oss's harmony format (``harmony``): channels, and calls to ``functions.*``.

A completion is a run of messages, each ``<|channel|>NAME<|message|>BODY`` ended by
``<|end|>``, ``<|call|>`` or ``<|return|>`` and joined by ``<|start|>assistant``:

- ``analysis``: reasoning, surfaced apart from the answer (``split_reasoning``) as the
  ``<think>`` block of other models is (OpenAI ``reasoning_content``, Anthropic ``thinking``);
- ``commentary to=functions.NAME <|constrain|>json``: a call, the body its JSON arguments
  (the recipient may also stand before ``<|channel|>``);
- ``final``, and ``commentary`` without a recipient (a preamble): the answer.

The answer's messages are joined by a blank line; text outside any message (a model that
writes no channels) is content too. A call whose body is not a JSON object, or to another
recipient (gpt-oss's built-in ``browser``/``python``), stays in the content as written.

>>> split_harmony("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4")
Reasoning(reasoning='Easy.', content='4')
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from areal_sdk.gateway.tool_parsers.base import (
    ParsedCompletion,
    ParsedToolCall,
    Reasoning,
    arguments_json,
    partial_suffix,
)

MARKERS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
)
_HEADER_START = re.compile(r"<\|start\|>|<\|channel\|>")
_BODY_END = re.compile(r"<\|(?:end|call|return)\|>|<\|start\|>|<\|channel\|>")
_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_RECIPIENT_BEFORE = re.compile(r"\s*\bto=[^\s<]+\s*$")  # "to=functions.f<|channel|>..."
_ANY_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))


@dataclass
class _Part:
    raw: str  # as written
    message: bool = False  # False: text outside any message, or an unfinished header
    channel: str = ""
    recipient: str = ""
    body: str = ""


def _parts(text: str) -> list[_Part]:
    parts: list[_Part] = []
    pos = 0
    while pos < len(text):
        found = _HEADER_START.search(text, pos)
        if found is None:
            parts.append(_Part(text[pos:]))
            break
        start = found.start()
        if found.group() == "<|channel|>":
            lead = _RECIPIENT_BEFORE.search(text, pos, start)
            start = lead.start() if lead else start
        if start > pos:
            parts.append(_Part(text[pos:start]))
        opened = text.find("<|message|>", start)
        if opened < 0:  # the header is still being written (or was cut off)
            parts.append(_Part(text[start:]))
            break
        header = text[start:opened]
        body_from = opened + len("<|message|>")
        end = _BODY_END.search(text, body_from)
        body_to = end.start() if end else len(text)
        pos = end.end() if end and end.group() in _TERMINATORS else body_to
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        parts.append(
            _Part(
                text[start:pos],
                message=True,
                channel=channel.group(1) if channel else "",
                recipient=recipient.group(1) if recipient else "",
                body=text[body_from:body_to],
            )
        )
    return parts


def _join(pieces: list[str]) -> str:
    return "\n\n".join(p for p in (piece.strip() for piece in pieces) if p)


def _answer_piece(part: _Part) -> str:
    """What a part adds to the content: a text message's body, anything else as written."""
    return part.body if part.message and not part.recipient else part.raw


def split_harmony(text: str) -> Reasoning:
    """``analysis`` messages as reasoning; the rest (calls still as written) as content."""
    reasoning, content = [], []
    for part in _parts(text):
        if part.message and part.channel == "analysis" and not part.recipient:
            reasoning.append(part.body)
        else:
            content.append(_answer_piece(part))
    return Reasoning(reasoning=_join(reasoning) if reasoning else None, content=_join(content))


def _call(part: _Part) -> ParsedToolCall | None:
    if not (part.message and part.recipient.startswith("functions.")):
        return None
    name = part.recipient[len("functions.") :]
    try:
        args = arguments_json(json.loads(part.body))
    except json.JSONDecodeError:
        return None
    return ParsedToolCall(name=name, arguments=args) if name and args is not None else None


def parse_harmony(text: str) -> ParsedCompletion:
    """Calls to ``functions.*`` and the answer's text; ``analysis`` is left out (it is
    ``split_reasoning``'s)."""
    calls, content = [], []
    for part in _parts(text):
        call = _call(part)
        if call is not None:
            calls.append(call)
        elif not (part.message and part.channel == "analysis" and not part.recipient):
            content.append(_answer_piece(part))
    return ParsedCompletion(content=_join(content), tool_calls=calls)


def _live_cut(text: str) -> int:
    """Content up to the first message still written as markup (a call)."""
    found = _ANY_MARKER.search(text)
    if found is None:
        return len(text) - partial_suffix(text, *MARKERS)
    lead = _RECIPIENT_BEFORE.search(text, 0, found.start())
    return lead.start() if lead else found.start()


parse_harmony.live_cut = _live_cut  # type: ignore[attr-defined]
parse_harmony.split_reasoning = split_harmony  # type: ignore[attr-defined]
