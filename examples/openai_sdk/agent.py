"""A tool-calling agent on the openai SDK, written as the OpenAI function-calling guide does.

Plain ``openai`` code; the only areal-sdk line is ``@areal.trace``. Inside ``areal-sdk
rollout examples/openai_sdk/config.yaml`` the default ``OpenAI()`` client talks to the policy
behind the gateway; outside a rollout it talks to OpenAI.
"""

from __future__ import annotations

import json

from openai import OpenAI

import areal_sdk as areal

client = OpenAI()

tools = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]


def add(a: int, b: int) -> int:
    return a + b


@areal.trace
def solve(task: dict) -> str:
    """Answer one task; the config's ``agent.reward`` scores the returned text."""
    messages = [
        {
            "role": "system",
            "content": "You are a calculator. Use the add tool, then answer with the number.",
        },
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(4):
        completion = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, tools=tools
        )
        message = completion.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message)
        for call in message.tool_calls:
            try:
                result = add(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as exc:  # the model's arguments did not parse
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return ""
