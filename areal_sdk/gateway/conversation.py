"""The gateway's one internal conversation shape, shared by every wire format.

Each route converts its request (OpenAI chat messages, Responses input items, Anthropic
content blocks) into a list of ``Message`` and its tools into ``Tool``; templating and the
token-exact history reuse work only on these. ``Message.key()`` is what "the same message"
means when a later request repeats an earlier conversation: role, text, tool calls by name
and arguments (as decoded JSON, so re-serialisation by a client does not matter) and the tool
call a result answers. Call ids and reasoning text are not part of it, since clients rewrite
the first and drop the second.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from areal_sdk.gateway.json_input import loads_checked


def new_call_id(prefix: str = "call") -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, exactly as returned to the client

    def arguments_obj(self) -> Any:
        try:
            return loads_checked(self.arguments)
        except (ValueError, TypeError):  # not usable JSON: the text as the client sent it
            return self.arguments


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None

    def key(self) -> tuple[Any, ...]:
        calls = tuple(
            (c.name, json.dumps(c.arguments_obj(), sort_keys=True)) for c in self.tool_calls
        )
        return (self.role, self.content, calls, self.tool_call_id if self.role == "tool" else None)

    def to_template(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_obj()},
                }
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_template(self) -> dict[str, Any]:
        """OpenAI's function-tool shape, which HF chat templates are written against."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def conversation_key(messages: list[Message]) -> tuple[tuple[Any, ...], ...]:
    return tuple(m.key() for m in messages)
