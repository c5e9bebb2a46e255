"""An OpenAI Agents SDK agent with a function tool, written as the SDK's quickstart does.

Plain ``agents`` code; the only areal-sdk line is ``@areal.trace``. Inside ``areal-sdk rollout
examples/openai_agents/config.yaml`` the SDK's default provider (Responses API, no base URL)
talks to the policy behind the gateway's ``/v1/responses``; outside a rollout it talks to
OpenAI.
"""

from __future__ import annotations

from agents import Agent, Runner, function_tool

import areal_sdk as areal


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


calculator = Agent(
    name="Calculator",
    instructions="You are a calculator. Use the add tool, then answer with the number.",
    model="gpt-4o-mini",
    tools=[add],
)


@areal.trace
async def solve(task: dict) -> str:
    """Answer one task; the config's ``agent.reward`` scores the returned text."""
    result = await Runner.run(calculator, task["question"], max_turns=4)
    return str(result.final_output)
