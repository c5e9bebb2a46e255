"""/v1/responses cut by max_output_tokens: OpenAI's ``incomplete`` semantics, and what the
OpenAI Agents SDK does with them (it raises ``ModelBehaviorError`` on any incomplete response,
as it does against OpenAI; an agent needs the output tokens its replies take).

The model (tests/gateway/reply_model.py) answers ``Hi there!`` and stops on its EOS.
"""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.gateway.reply_model import QUESTION, REPLY


@pytest.fixture
def client(reply_gateway):
    return OpenAI(base_url=reply_gateway.base_url + "/v1", api_key=reply_gateway.admin)


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client):
    whole = client.responses.create(model="m", input=QUESTION, temperature=0)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output[0].status == "completed" and whole.output_text == REPLY
    n = whole.usage.output_tokens  # the reply and its EOS

    # A budget that the reply and its EOS fill exactly: the model stopped, nothing was cut.
    fits = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=n)
    assert fits.status == "completed" and fits.output_text == REPLY

    # One token less: the reply is all there, but the model had not stopped.
    cut = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=n - 1)
    assert cut.status == "incomplete"
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.max_output_tokens == n - 1 and cut.usage.output_tokens == n - 1
    assert cut.output[0].status == "incomplete"

    events = list(
        client.responses.create(
            model="m", input=QUESTION, temperature=0, max_output_tokens=2, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    assert "response.completed" not in {e.type for e in events}
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    partial = events[-1].response.output_text
    assert REPLY.startswith(partial) and partial != REPLY


def test_the_agents_sdk_raises_on_incomplete_and_runs_with_enough_tokens(reply_gateway):
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from agents.exceptions import ModelBehaviorError

    async def run(max_tokens: int) -> str:
        model = OpenAIResponsesModel(
            model="gpt-4o-mini",
            openai_client=AsyncOpenAI(
                base_url=reply_gateway.base_url + "/v1", api_key=reply_gateway.admin
            ),
        )
        agent = Agent(
            name="Greeter",
            instructions=None,
            model=model,
            model_settings=ModelSettings(temperature=0.0, max_tokens=max_tokens),
        )
        # No tracing: a run outside an episode would be exported to OpenAI by default.
        result = await Runner.run(agent, QUESTION, run_config=RunConfig(tracing_disabled=True))
        return str(result.final_output)

    assert agents is not None
    with pytest.raises(ModelBehaviorError, match="max_output_tokens"):
        asyncio.run(run(2))
    assert asyncio.run(run(32)) == REPLY
