"""The quickstart agent: plain OpenAI SDK code answering sums in a strict format.

The only areal-sdk line is ``@areal.trace``. The reward is 1 for exactly
``<answer>N</answer>`` with the right N and 0 otherwise, so the policy has two things to
learn: the format, and the arithmetic.
"""

from __future__ import annotations

import re

from openai import OpenAI

import areal_sdk as areal

client = OpenAI()

SYSTEM = "Answer in the form <answer>NUMBER</answer>."
# Two worked examples show the format; the sums themselves the model must get right.
EXAMPLES = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
    {"role": "user", "content": "What is 10 + 4?"},
    {"role": "assistant", "content": "<answer>14</answer>"},
]
ANSWER = re.compile(r"\s*<answer>\s*(-?\d+)\s*</answer>\s*")


def score(text: str, expected: str) -> float:
    """1.0 for exactly one well-formed answer tag holding the expected number."""
    match = ANSWER.fullmatch(text)
    return float(match is not None and match.group(1) == expected)


@areal.trace
def solve(task: dict, temperature: float = 1.0, max_tokens: int = 16) -> float:
    reply = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "system", "content": SYSTEM},
            *EXAMPLES,
            {"role": "user", "content": task["question"]},
        ],
        temperature=temperature,
        max_tokens=max_tokens,
    )
    return score(reply.choices[0].message.content or "", task["answer"])
