"""/v1/responses and /v1/completions with the random tiny model."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer


def test_responses_basic_and_previous_response_id(gateway):
    episode_id, key = gateway.open_session()
    c = OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    first = c.responses.create(
        model="gpt-4o",
        instructions="Be brief.",
        input="What is 2 + 3?",
        max_output_tokens=6,
        include=["message.output_text.logprobs"],
    )
    assert first.object == "response" and first.id.startswith("resp_")
    msg = first.output[-1]
    assert msg.type == "message" and msg.role == "assistant"
    assert len(msg.content[0].logprobs) <= first.usage.output_tokens
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"
    second = c.responses.create(
        model="gpt-4o",
        instructions="Be brief.",
        input="And 1 + 1?",
        previous_response_id=first.id,
        max_output_tokens=6,
    )
    turns = gateway.episode(episode_id)["turns"]
    assert [t["api"] for t in turns] == ["openai.responses"] * 2
    assert turns[1]["metadata"]["prompt_source"] == "merged"
    assert second.usage.input_tokens == len(turns[1]["prompt_ids"])
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="x", previous_response_id="resp_unknown")


def test_responses_stream_events(gateway):
    c = OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.admin, max_retries=0)
    events = list(
        c.responses.create(
            model="m",
            stream=True,
            max_output_tokens=5,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # a completion cut by max_output_tokens ends with response.incomplete, as OpenAI's does
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.status == kinds[-1].split(".")[1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    delta = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert delta == final.output_text


def test_completions_text_and_token_prompts(gateway, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    episode_id, key = gateway.open_session()
    c = OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    r = c.completions.create(
        model="m", prompt="Q: What is 2 + 3?\nA:", max_tokens=5, logprobs=1, echo=True, seed=4
    )
    assert r.object == "text_completion"
    assert r.choices[0].text.startswith("Q: What is 2 + 3?\nA:")
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    ids = tok("Q: What is")["input_ids"]
    r2 = c.completions.create(model="m", prompt=ids, max_tokens=3, n=2)
    assert len(r2.choices) == 2
    turns = gateway.episode(episode_id)["turns"]
    assert [t["api"] for t in turns] == ["openai.completions"] * 3
    assert turns[0]["prompt_ids"] == tok("Q: What is 2 + 3?\nA:")["input_ids"]
    assert turns[1]["prompt_ids"] == ids
    sampled = turns[0]["completion_ids"]
    shown = sampled[:-1] if sampled[-1] == tok.eos_token_id else sampled
    assert r.choices[0].text == "Q: What is 2 + 3?\nA:" + tok.decode(
        shown, skip_special_tokens=False
    )
    # a prompt that continues an earlier prompt + completion reuses its sampled ids
    cont = (
        "Q: What is 2 + 3?\nA:"
        + tok.decode(turns[0]["completion_ids"], skip_special_tokens=False)
        + "\nQ: again?"
    )
    c.completions.create(model="m", prompt=cont, max_tokens=2)
    last = gateway.episode(episode_id)["turns"][-1]
    done = turns[0]["prompt_ids"] + turns[0]["completion_ids"]
    assert last["prompt_ids"][: len(done)] == done


def test_completions_stream(gateway):
    c = OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.admin, max_retries=0)
    plain = c.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0)
    chunks = list(
        c.completions.create(
            model="m",
            prompt="Hello",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
