"""Top logprobs, client turn metadata, and live streaming (tokens out as they are sampled)."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.conftest import ADMIN

QUESTION = [{"role": "user", "content": "Count from one to ten."}]
LONG = {"ignore_eos": True}  # keeps the tiny model going to max_tokens


def client(gateway, key: str = ADMIN) -> OpenAI:
    return OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def test_chat_top_logprobs_in_openai_format(gateway):
    c = client(gateway)
    r = c.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content
    assert entries
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        # greedy: the sampled token is the likeliest, with the same logprob
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert e.top_logprobs[0].bytes == list(e.token.encode())
    streamed = [
        entry
        for chunk in c.chat.completions.create(
            model="m",
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
        for choice in chunk.choices
        if choice.logprobs and choice.logprobs.content
        for entry in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in entries
    ]


def test_top_logprobs_needs_logprobs_and_a_range(gateway):
    c = client(gateway)
    for kwargs in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=QUESTION, max_tokens=2, **kwargs)
        assert err.value.body["param"] == "top_logprobs"


def test_completions_top_logprobs_dicts(gateway):
    r = client(gateway).completions.create(
        model="m", prompt="one two three", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 5
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and top[tok] == pytest.approx(value, abs=1e-6)
        assert max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy


def test_responses_top_logprobs(gateway):
    r = client(gateway).responses.create(
        model="m",
        input="hello",
        max_output_tokens=4,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    entries = r.output[0].content[0].logprobs
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


def test_metadata_header_lands_in_the_turn(gateway):
    episode_id, key = gateway.open_session(task_id="meta")
    meta = {"langchain": {"run_id": "r1", "tags": ["x"]}}
    client(gateway, key).chat.completions.create(
        model="m",
        messages=QUESTION,
        max_tokens=2,
        extra_headers={"x-areal-metadata": json.dumps(meta)},
    )
    [turn] = gateway.episode(episode_id)["turns"]
    assert turn["metadata"]["langchain"] == meta["langchain"]
    assert turn["metadata"]["choice"] == 0  # the gateway's own keys stay


@pytest.mark.parametrize("header", ["{not json", "[1, 2]", '"text"'])
def test_malformed_metadata_header_is_400_in_each_format(gateway, header):
    _, key = gateway.open_session()
    with pytest.raises(openai.BadRequestError) as err:
        client(gateway, key).chat.completions.create(
            model="m", messages=QUESTION, max_tokens=2, extra_headers={"x-areal-metadata": header}
        )
    assert err.value.body["param"] == "x-areal-metadata"
    r = httpx.post(
        gateway.base_url + "/v1/messages",
        headers={"x-api-key": key, "x-areal-metadata": header, "anthropic-version": "2023-06-01"},
        json={"model": "m", "max_tokens": 2, "messages": QUESTION},
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_chat_stream_is_live(gateway, engine):
    """The first content arrives while the engine is still sampling the same request."""
    body = {"model": "m", "messages": QUESTION, "max_tokens": 300, "stream": True, **LONG}
    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                break
        assert engine.num_running == 1  # still generating: this is not a replay
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


def test_stream_and_whole_call_agree(gateway):
    c = client(gateway)
    kwargs = {"model": "m", "messages": QUESTION, "max_tokens": 24, "seed": 5, "temperature": 1.0}
    whole = c.chat.completions.create(**kwargs).choices[0].message.content
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(stream=True, **kwargs)
        if ch.choices
    ]
    assert "".join(parts) == whole and len([p for p in parts if p]) > 1
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=ADMIN, max_retries=0)
    msg = {"model": "m", "max_tokens": 24, "messages": QUESTION}
    with a.messages.stream(**msg) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text


def test_leaving_a_stream_records_what_was_sampled(gateway, engine):
    episode_id, key = gateway.open_session(task_id="gone")
    body = {"model": "m", "messages": QUESTION, "max_tokens": 400, "stream": True, **LONG}
    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ) as r:
        turn_id = r.headers["x-areal-turn-ids"]
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 4:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        turns = gateway.episode(episode_id)["turns"]
        if turns and engine.num_running == 0:
            break
        time.sleep(0.05)
    [turn] = gateway.episode(episode_id)["turns"]
    assert turn["id"] == turn_id and turn["finish_reason"] == "abort"
    n = len(turn["completion_ids"])
    assert 0 < n < 400 and len(turn["logprobs"]) == len(turn["versions"]) == n
    assert engine.num_running == 0  # the engine stopped sampling it
    assert gateway.end(episode_id).status_code == 200


def test_responses_stream_deltas_add_up(gateway):
    c = client(gateway)
    deltas, final = [], None
    for ev in c.responses.create(
        model="m", input="hi", max_output_tokens=12, temperature=0, stream=True
    ):
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and "".join(deltas) == final.output_text
