"""A GSM8K solver written with the OpenAI SDK: reason step by step, end with ``#### N``.

The config's ``agent.reward: gsm8k`` scores the returned text by its final number against
the dataset's ``#### N`` answer.
"""

from __future__ import annotations

from openai import AsyncOpenAI

import areal_sdk as areal

client = AsyncOpenAI()

SYSTEM = (
    "Solve the math word problem step by step. On the last line write the final answer as "
    "'#### NUMBER'."
)


@areal.trace
async def solve(task: dict, temperature: float = 1.0, max_tokens: int = 512) -> str:
    reply = await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["question"]},
        ],
        temperature=temperature,
        max_tokens=max_tokens,
    )
    return reply.choices[0].message.content or ""
