"""A tool-use agent on the anthropic SDK, written as Anthropic's tool-use guide does.

Plain ``anthropic`` code; the only areal-sdk line is ``@areal.trace``. Inside ``areal-sdk
rollout examples/anthropic_sdk/config.yaml`` the default ``Anthropic()`` client talks to the
policy behind the gateway's Messages API; outside a rollout it talks to Anthropic.
"""

from __future__ import annotations

import anthropic

import areal_sdk as areal

client = anthropic.Anthropic()

tools = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
]


def add(a: int, b: int) -> int:
    return a + b


@areal.trace
def solve(task: dict) -> str:
    """Answer one task; the config's ``agent.reward`` scores the returned text."""
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(4):
        response = client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=256,
            system="You are a calculator. Use the add tool, then answer with the number.",
            tools=tools,
            messages=messages,
        )
        if response.stop_reason != "tool_use":
            return "".join(block.text for block in response.content if block.type == "text")
        messages.append({"role": "assistant", "content": response.content})
        results = []
        for block in response.content:
            if block.type == "tool_use":
                try:
                    content, is_error = str(add(**block.input)), False
                except TypeError as exc:  # the model's input did not fit the schema
                    content, is_error = f"error: {exc}", True
                results.append(
                    {
                        "type": "tool_result",
                        "tool_use_id": block.id,
                        "content": content,
                        "is_error": is_error,
                    }
                )
        messages.append({"role": "user", "content": results})
    return ""
