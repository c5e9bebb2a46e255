"""Streamed text equals non-streamed text on every route, for a reply that ends on its own.

The model (tests/gateway/reply_model.py) answers ``Hi there!`` and stops on its EOS, the
special token ``<|im_end|>``; greedy sampling makes the streamed and the whole reply the
same completion, so their texts must match and hold no end-of-turn marker.
"""

from __future__ import annotations

import logging

import anthropic
import pytest
from openai import OpenAI

from tests.gateway.reply_model import QUESTION, REPLY

ASK = [{"role": "user", "content": QUESTION}]


@pytest.fixture
def openai_client(reply_gateway):
    return OpenAI(base_url=reply_gateway.base_url + "/v1", api_key=reply_gateway.admin)


@pytest.fixture(autouse=True)
def no_divergence(caplog):
    """The gateway logs when a stream's text diverged from the completion's final reading."""
    with caplog.at_level(logging.WARNING, logger="areal_sdk.gateway"):
        yield
    assert "diverged" not in caplog.text


def test_chat_stream_matches_the_whole_reply(openai_client):
    whole = openai_client.chat.completions.create(model="m", messages=ASK, temperature=0)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == REPLY
    chunks = list(
        openai_client.chat.completions.create(model="m", messages=ASK, temperature=0, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_responses_stream_matches_the_whole_reply(openai_client):
    whole = openai_client.responses.create(model="m", input=QUESTION, temperature=0)
    assert whole.status == "completed" and whole.output_text == REPLY
    events = list(
        openai_client.responses.create(model="m", input=QUESTION, temperature=0, stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == REPLY
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == REPLY


def test_completions_stream_matches_the_whole_reply(openai_client):
    whole = openai_client.completions.create(model="m", prompt=QUESTION, temperature=0)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].text == " " + REPLY
    chunks = list(
        openai_client.completions.create(model="m", prompt=QUESTION, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " " + REPLY


def test_messages_stream_matches_the_whole_reply(reply_gateway):
    client = anthropic.Anthropic(
        base_url=reply_gateway.base_url, api_key=reply_gateway.admin, max_retries=0
    )
    whole = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=32, messages=ASK, extra_body={"temperature": 0}
    )
    assert whole.stop_reason == "end_turn" and whole.content[0].text == REPLY
    with client.messages.stream(
        model="claude-sonnet-4-5", max_tokens=32, messages=ASK, extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == REPLY
    assert final.stop_reason == "end_turn" and final.content[0].text == REPLY
