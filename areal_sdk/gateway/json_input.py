"""JSON from clients that the gateway can serve: ``loads_checked`` refuses, as a ``ValueError``
that says why, text that parses but that no tokenizer, template or store could use."""

from __future__ import annotations

import json
from typing import Any

# Deeper JSON is refused: no API request needs it, and Python's own parser, encoder and
# templates recurse on it (a few hundred levels already break some of them).
MAX_JSON_DEPTH = 100


def _unservable(value: Any) -> str | None:
    """Why parsed JSON cannot be served (None if it can): a string with a lone UTF-16
    surrogate (valid JSON escapes, but no text a tokenizer or the store can encode), or
    nesting deeper than ``MAX_JSON_DEPTH``. Walked without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and not _encodable(node):
                return "a string holds a lone UTF-16 surrogate (like \\ud800), which is not text"
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            return f"it is nested more than {MAX_JSON_DEPTH} levels deep"
        if isinstance(node, dict):
            stack.extend((key, depth) for key in node)
            node = node.values()
        stack.extend((item, depth + 1) for item in node)
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def loads_checked(raw: str | bytes) -> Any:
    """``json.loads`` that also refuses JSON the gateway cannot serve; raises ``ValueError``."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"it is nested more than {MAX_JSON_DEPTH} levels deep") from None
    why = _unservable(value)
    if why is not None:
        raise ValueError(why)
    return value
