"""A CAMEL ``ChatAgent`` with a function tool, written as CAMEL's agents guide does.

Plain CAMEL code; the only areal-sdk line is ``@areal.trace``. Inside ``areal-sdk rollout
examples/camel/config.yaml`` the ``OPENAI`` platform backend (left at its default URL) talks
to the policy behind the gateway; outside a rollout it talks to OpenAI. Needs its own
environment: ``pip install "areal-sdk[camel]"`` (see docs/extras.md).
"""

from __future__ import annotations

from camel.agents import ChatAgent
from camel.models import ModelFactory
from camel.toolkits import FunctionTool
from camel.types import ModelPlatformType, ModelType

import areal_sdk as areal


def add(a: int, b: int) -> int:
    r"""Add two integers.

    Args:
        a (int): The first number.
        b (int): The second number.

    Returns:
        int: The sum.
    """
    return a + b


@areal.trace
def solve(task: dict) -> str:
    """Answer one task; the config's ``agent.reward`` scores the returned text."""
    model = ModelFactory.create(
        model_platform=ModelPlatformType.OPENAI,
        model_type=ModelType.GPT_4O_MINI,
        model_config_dict={"temperature": 0.7},
    )
    agent = ChatAgent(
        system_message="You are a calculator. Use the add tool, then answer with the number.",
        model=model,
        tools=[FunctionTool(add)],
        max_iteration=4,
    )
    response = agent.step(task["question"])
    return response.msgs[0].content if response.msgs else ""
