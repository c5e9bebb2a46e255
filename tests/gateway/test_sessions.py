"""Sessions: keys tie calls to episodes, ending stores the episode, nobody sees another's."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def client(gateway, key):
    return OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def test_creating_a_session_needs_the_admin_token(gateway):
    r = httpx.post(gateway.base_url + "/rl/sessions", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(gateway.base_url + "/rl/sessions")
    assert r.status_code == 401


def test_keys_are_unguessable(gateway):
    a_id, a_key = gateway.open_session()
    _, b_key = gateway.open_session()
    assert a_key != b_key and a_id not in a_key and a_id[3:] not in a_key
    assert a_key.startswith("sk-areal-") and len(a_key) >= 40


def test_unknown_key_is_401_in_each_api_format(gateway):
    with pytest.raises(openai.AuthenticationError) as err:
        client(gateway, "sk-areal-made-up").chat.completions.create(model="m", messages=ASK)
    assert err.value.body["code"] == "invalid_api_key"
    r = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": ASK},
        headers={"Authorization": "Bearer sk-areal-made-up"},
    )
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key="sk-areal-made-up", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        a.messages.create(model="claude", max_tokens=4, messages=ASK)
    r = httpx.post(
        gateway.base_url + "/v1/messages",
        json={"model": "c", "max_tokens": 4, "messages": ASK},
        headers={"x-api-key": "sk-areal-made-up"},
    )
    assert r.status_code == 401
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
    }


def test_end_stores_the_episode_before_acknowledging(gateway):
    episode_id, key = gateway.open_session(task_id="task-7", group_id="g1", metadata={"k": "v"})
    c = client(gateway, key)
    raw = c.chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=4)
    turn_id = raw.headers["x-areal-turn-ids"]
    assert raw.headers["x-areal-episode-id"] == episode_id
    r = httpx.post(
        f"{gateway.base_url}/rl/sessions/{episode_id}/reward",
        json={"reward": 0.5, "turn_id": turn_id},
        headers={"Authorization": f"Bearer {gateway.admin}"},
    )
    assert r.status_code == 200
    ack = gateway.end(episode_id, reward=1.0)
    assert ack.status_code == 200 and ack.json()["stored"] is True
    stored = gateway.store.get(episode_id)  # durable the moment the call returned
    assert stored.reward == 1.0 and stored.task_id == "task-7" and stored.group_id == "g1"
    assert stored.metadata == {"k": "v"} and stored.ended is not None
    [turn] = stored.turns
    assert turn.id == turn_id and turn.reward == 0.5
    # the key is dead now
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model="m", messages=ASK, max_tokens=2)
    assert gateway.end(episode_id).json()["stored"] is True  # ending again is harmless


def test_a_session_can_end_itself_with_its_own_key(gateway):
    episode_id, key = gateway.open_session()
    r = httpx.post(
        f"{gateway.base_url}/rl/sessions/{episode_id}/end",
        json={"status": "failed", "error": "tool crashed"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200
    assert gateway.store.get(episode_id).status == "failed"


def test_one_episode_cannot_touch_another(gateway):
    a_id, a_key = gateway.open_session()
    b_id, b_key = gateway.open_session()
    client(gateway, b_key).chat.completions.create(model="m", messages=ASK, max_tokens=3)
    h = {"Authorization": f"Bearer {a_key}"}
    base = f"{gateway.base_url}/rl/sessions/{b_id}"
    assert httpx.get(base, headers=h).status_code == 404
    assert httpx.post(base + "/reward", json={"reward": 1.0}, headers=h).status_code == 404
    assert httpx.post(base + "/end", headers=h).status_code == 404
    assert httpx.get(f"{gateway.base_url}/rl/sessions/{a_id}", headers=h).json()["turns"] == []
    # B's response cannot be continued with A's key
    rb = client(gateway, b_key).responses.create(model="m", input="hi", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client(gateway, a_key).responses.create(
            model="m", input="again", max_output_tokens=3, previous_response_id=rb.id
        )
    assert len(gateway.episode(b_id)["turns"]) == 2 and gateway.episode(a_id)["turns"] == []


def test_history_is_never_reused_across_episodes(gateway):
    a_id, a_key = gateway.open_session()
    b_id, b_key = gateway.open_session()
    r = client(gateway, a_key).chat.completions.create(model="m", messages=ASK, max_tokens=4)
    follow = [
        *ASK,
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "Sure?"},
    ]
    client(gateway, b_key).chat.completions.create(model="m", messages=follow, max_tokens=2)
    client(gateway, a_key).chat.completions.create(model="m", messages=follow, max_tokens=2)
    assert gateway.episode(b_id)["turns"][0]["metadata"]["prompt_source"] == "templated"
    assert gateway.episode(a_id)["turns"][1]["metadata"]["prompt_source"] == "merged"


def test_rl_routes_validate_bodies_with_422(gateway):
    h = {"Authorization": f"Bearer {gateway.admin}"}
    r = httpx.post(gateway.base_url + "/rl/sessions", json={"bogus": 1}, headers=h)
    assert r.status_code == 422 and r.json()["error"]["param"] == "bogus"
    episode_id, _ = gateway.open_session()
    r = httpx.post(
        f"{gateway.base_url}/rl/sessions/{episode_id}/reward", json={"reward": "high"}, headers=h
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "reward"
    r = httpx.post(
        f"{gateway.base_url}/rl/sessions/{episode_id}/reward",
        json={"reward": 1, "turn_id": "turn-nope"},
        headers=h,
    )
    assert r.status_code == 404
