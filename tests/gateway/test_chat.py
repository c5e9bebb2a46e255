"""/v1/chat/completions through the official openai client, over the real engine."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

QUESTION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2 + 3?"},
]


@pytest.fixture
def session(gateway):
    episode_id, key = gateway.open_session(task_id="chat")
    return episode_id, OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def turns(gateway, episode_id):
    return gateway.episode(episode_id)["turns"]


def test_chat_records_a_token_exact_turn(gateway, session, tiny_model_dir):
    episode_id, client = session
    r = client.chat.completions.create(
        model="gpt-4o", messages=QUESTION, max_tokens=8, logprobs=True, seed=1
    )
    assert r.object == "chat.completion" and r.model == "gpt-4o"
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    [turn] = turns(gateway, episode_id)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the prompt is the chat template applied to the request, token for token
    assert turn["prompt_ids"] == tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = turn["completion_ids"]
    shown = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
    assert tok.decode(shown, skip_special_tokens=False) == choice.message.content
    assert len(turn["logprobs"]) == len(turn["versions"]) == len(ids)
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
        turn["logprobs"][: len(shown)]
    )
    assert r.usage.prompt_tokens == len(turn["prompt_ids"])
    assert r.usage.completion_tokens == len(ids)
    assert turn["api"] == "openai.chat" and turn["request"]["messages"] == QUESTION


def test_max_tokens_and_seed(session):
    _, client = session
    a = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        max_completion_tokens=5,
        seed=7,
        temperature=1.0,
        top_p=0.9,
        extra_body={"ignore_eos": True},
    )
    b = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        max_tokens=5,
        seed=7,
        temperature=1.0,
        top_p=0.9,
        extra_body={"ignore_eos": True},
    )
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 5
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_choices_are_separate_turns(gateway, session):
    episode_id, client = session
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=6, n=3, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    recorded = turns(gateway, episode_id)
    assert len(recorded) == 3
    assert {t["metadata"]["choice"] for t in recorded} == {0, 1, 2}
    assert r.usage.completion_tokens == sum(len(t["completion_ids"]) for t in recorded)


def test_stop_string_is_cut_from_the_text(session):
    _, client = session
    free = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=12, seed=5, temperature=0
    )
    text = free.choices[0].message.content
    assert len(text) > 3
    stop = text[2:4]
    cut = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=12, seed=5, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]


def test_streaming_with_usage_matches_the_turn(gateway, session, tiny_model_dir):
    episode_id, client = session
    stream = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        max_tokens=8,
        seed=2,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    [turn] = turns(gateway, episode_id)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = turn["completion_ids"]
    shown = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
    assert text == tok.decode(shown, skip_special_tokens=False)
    assert len(finish) == 1 and usage.completion_tokens == len(ids)
    assert usage.prompt_tokens == len(turn["prompt_ids"])


def test_return_token_ids_extra(session):
    _, client = session
    r = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=4, extra_body={"return_token_ids": True}
    )
    extra = r.model_extra
    assert isinstance(extra["prompt_token_ids"], list)
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens


def test_admin_token_calls_are_served_but_not_recorded(gateway):
    client = OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.admin, max_retries=0)
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
    assert r.choices[0].message.role == "assistant"
    assert gateway.store.count() == 0


def test_models_health_metrics(gateway, session, engine):
    _, client = session
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    assert client.models.retrieve("gpt-4o").id == "gpt-4o"
    health = httpx.get(gateway.base_url + "/health").json()
    assert health["status"] == "ok"
    client.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
    text = httpx.get(gateway.base_url + "/metrics").text
    assert 'areal_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "areal_gateway_tokens_total" in text and "areal_gateway_sessions_active 1.0" in text


def test_a_client_that_leaves_stops_its_generation(gateway, engine):
    """An agent that gives up (here, its HTTP timeout) must not leave the engine sampling a
    reply nobody will read: the gateway cancels the call and the engine aborts it."""
    import time

    import openai

    _, key = gateway.open_session(task_id="leave")
    client = OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=0.3)
    before = engine.stats().sampled_tokens
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=900, extra_body={"ignore_eos": True}
        )
    deadline = time.monotonic() + 10
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0
    assert engine.stats().sampled_tokens - before < 900
