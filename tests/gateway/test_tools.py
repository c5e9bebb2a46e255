"""Tool round trips with a model fitted to really call ``add`` (tests/gateway/tool_model.py).

The same conversation goes through chat completions, Anthropic messages and the Responses
API; each time the call is parsed from the sampled text, the result goes back in the API's
own shape, and the two turns merge into one sequence: the sampled call ids, then template
tokens for the tool result, then the sampled answer.
"""

from __future__ import annotations

import json

import anthropic
import httpx
from openai import OpenAI

from areal_sdk.samples import MergeStats, build_samples
from tests.gateway.tool_model import (
    ADD_DESCRIPTION,
    ADD_SCHEMA,
    ANSWER,
    CALL_TEXT,
    OPENAI_TOOLS,
    QUESTION,
)

ANTHROPIC_TOOLS = [{"name": "add", "description": ADD_DESCRIPTION, "input_schema": ADD_SCHEMA}]
RESPONSES_TOOLS = [
    {"type": "function", "name": "add", "description": ADD_DESCRIPTION, "parameters": ADD_SCHEMA}
]
GREEDY = {"temperature": 0}


def check_exact_merge(gw, episode_id, tokenizer):
    assert gw.end(episode_id, reward=1.0).status_code == 200
    episode = gw.store.get(episode_id)
    t1, t2 = episode.turns
    assert (
        tokenizer.decode(t1.completion_ids, skip_special_tokens=False) == CALL_TEXT + "<|im_end|>"
    )
    assert tokenizer.decode(t2.completion_ids, skip_special_tokens=False) == ANSWER + "<|im_end|>"
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    stats = MergeStats()
    [sample] = build_samples(episode, stats=stats)
    assert stats.merged == 1
    between = t2.prompt_ids[len(t1.prompt_ids) + len(t1.completion_ids) :]
    rendered = tokenizer.decode(between, skip_special_tokens=False)
    assert (
        rendered
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.input_ids == [*t1.prompt_ids, *t1.completion_ids, *between, *t2.completion_ids]
    assert sum(sample.loss_mask) == len(t1.completion_ids) + len(t2.completion_ids)
    return episode


def test_chat_tool_round_trip(tool_gateway, tool_engine):
    episode_id, key = tool_gateway.open_session()
    client = OpenAI(base_url=tool_gateway.base_url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(
        model="gpt-4o", messages=messages, tools=OPENAI_TOOLS, **GREEDY
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    r2 = client.chat.completions.create(
        model="gpt-4o", messages=messages, tools=OPENAI_TOOLS, **GREEDY
    )
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    check_exact_merge(tool_gateway, episode_id, tool_engine.tokenizer)


def test_chat_tool_call_streams(tool_gateway):
    client = OpenAI(
        base_url=tool_gateway.base_url + "/v1", api_key=tool_gateway.admin, max_retries=0
    )
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTION}],
        tools=OPENAI_TOOLS,
        stream=True,
        **GREEDY,
    )
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["add"]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice="none" leaves the tools out, so nothing is parsed as a call
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTION}],
        tools=OPENAI_TOOLS,
        tool_choice="none",
        max_tokens=8,
        **GREEDY,
    )
    assert r.choices[0].message.tool_calls is None


def test_anthropic_tool_use_and_tool_result(tool_gateway, tool_engine):
    episode_id, key = tool_gateway.open_session()
    a = anthropic.Anthropic(base_url=tool_gateway.base_url, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    first = a.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=64,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
    assert first.usage.output_tokens == len(tool_engine.tokenizer(CALL_TEXT)["input_ids"]) + 1
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
        },
    ]
    second = a.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=64,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        extra_body=GREEDY,
    )
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == ANSWER
    episode = check_exact_merge(tool_gateway, episode_id, tool_engine.tokenizer)
    assert episode.turns[0].api == "anthropic.messages"


def test_anthropic_streams_named_events(tool_gateway):
    a = anthropic.Anthropic(
        base_url=tool_gateway.base_url, api_key=tool_gateway.admin, max_retries=0
    )
    with a.messages.stream(
        model="claude",
        max_tokens=64,
        tools=ANTHROPIC_TOOLS,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"a": 2, "b": 3}
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
    } <= set(kinds)
    # raw SSE: every event is named
    r = httpx.post(
        tool_gateway.base_url + "/v1/messages",
        headers={"x-api-key": tool_gateway.admin},
        json={
            "model": "c",
            "max_tokens": 64,
            "stream": True,
            "tools": ANTHROPIC_TOOLS,
            "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}],
        },
    )
    names = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    datas = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(names) == len(datas) and "input_json_delta" in r.text


def test_responses_function_call_round_trip(tool_gateway, tool_engine):
    episode_id, key = tool_gateway.open_session()
    client = OpenAI(base_url=tool_gateway.base_url + "/v1", api_key=key, max_retries=0)
    first = client.responses.create(model="gpt-4o", input=QUESTION, tools=RESPONSES_TOOLS, **GREEDY)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "add"
    assert json.loads(call.arguments) == {"a": 2, "b": 3}
    second = client.responses.create(
        model="gpt-4o",
        previous_response_id=first.id,
        tools=RESPONSES_TOOLS,
        **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
    )
    assert second.output_text == ANSWER
    episode = check_exact_merge(tool_gateway, episode_id, tool_engine.tokenizer)
    assert episode.turns[1].api == "openai.responses"


def test_responses_without_previous_id_replays_items(tool_gateway):
    client = OpenAI(
        base_url=tool_gateway.base_url + "/v1", api_key=tool_gateway.admin, max_retries=0
    )
    first = client.responses.create(
        model="m", input=[{"role": "user", "content": QUESTION}], tools=RESPONSES_TOOLS, **GREEDY
    )
    call = first.output[0]
    items = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]
    with client.responses.stream(model="m", input=items, tools=RESPONSES_TOOLS, **GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == ANSWER
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
