"""A session's life over HTTP: rewards must be finite, ending twice is harmless, episode ids
are never reused, and a session nobody ends expires and is stored as failed."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.conftest import ADMIN, serve

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def post(gateway, path: str, body: bytes | None = None, key: str = ADMIN) -> httpx.Response:
    return httpx.post(
        gateway.base_url + path,
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


def call(gateway, key: str) -> None:
    c = OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    c.chat.completions.create(model="m", messages=ASK, max_tokens=3)


def open_sessions(gateway) -> float:
    text = httpx.get(gateway.base_url + "/metrics").text
    return float(re.search(r"^areal_gateway_sessions_active (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("bad", [b"NaN", b"Infinity", b"-Infinity", b'"NaN"'])
def test_a_non_finite_reward_is_a_400_and_changes_nothing(gateway, bad):
    episode_id, key = gateway.open_session()
    call(gateway, key)
    turn_id = gateway.episode(episode_id)["turns"][0]["id"]
    assert post(gateway, f"/rl/sessions/{episode_id}/reward", b'{"reward": 0.5}').status_code == 200
    for body in (
        b'{"reward": %s}' % bad,
        b'{"reward": %s, "turn_id": "%s"}' % (bad, turn_id.encode()),
    ):
        r = post(gateway, f"/rl/sessions/{episode_id}/reward", body)
        assert r.status_code in (400, 422) and r.json()["error"]["param"] == "reward", r.text
    r = post(gateway, f"/rl/sessions/{episode_id}/end", b'{"reward": %s}' % bad, key)
    assert r.status_code in (400, 422) and r.json()["error"]["param"] == "reward", r.text
    if bad != b'"NaN"':  # a string is a schema error (422); a non-finite number a 400
        assert r.status_code == 400
    # Nothing changed: the session is open, readable, and ends with the reward it had.
    episode = gateway.episode(episode_id)
    assert episode["reward"] == 0.5 and episode["turns"][0]["reward"] is None
    with pytest.raises(Exception, match="no episode"):
        gateway.store.get(episode_id)
    ack = gateway.end(episode_id)
    assert ack.status_code == 200 and ack.json()["reward"] == 0.5
    assert gateway.store.get(episode_id).reward == 0.5


def test_ending_twice_is_harmless(gateway):
    episode_id, key = gateway.open_session()
    call(gateway, key)
    first = post(gateway, f"/rl/sessions/{episode_id}/end", b'{"reward": 1.0}', key)
    assert first.status_code == 200, first.text
    assert first.json() == {
        "id": episode_id,
        "status": "ok",
        "reward": 1.0,
        "turns": 1,
        "stored": True,
    }
    # Again with the session's own key, with the admin token, and with another outcome:
    # each answers what the first end stored, which stands.
    again = post(gateway, f"/rl/sessions/{episode_id}/end", b'{"status": "failed"}', key)
    assert again.status_code == 200 and again.json() == first.json()
    assert gateway.end(episode_id, reward=0.0).json() == first.json()
    stored = gateway.store.get(episode_id)
    assert stored.reward == 1.0 and stored.status == "ok" and len(stored.turns) == 1
    assert gateway.store.count() == 1
    # The key still makes no calls, and an ended episode takes no reward.
    with pytest.raises(openai.AuthenticationError):
        call(gateway, key)
    r = post(gateway, f"/rl/sessions/{episode_id}/reward", b'{"reward": 1}', key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    assert open_sessions(gateway) == 0


def test_a_duplicate_episode_id_is_a_409_and_leaves_no_session_open(gateway):
    episode_id, _ = gateway.open_session(episode_id="ep-dup")
    assert gateway.end(episode_id).status_code == 200
    r = post(gateway, "/rl/sessions", b'{"episode_id": "ep-dup"}')
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
    assert open_sessions(gateway) == 0 and gateway.store.count() == 1


def test_an_id_already_in_the_store_is_a_409_at_end(engine, tmp_path):
    """A gateway restarted on the same store cannot know the id at creation; the end says."""
    for attempt in range(2):
        for gw in serve(engine, tmp_path, default_max_tokens=4):
            episode_id, key = gw.open_session(episode_id="ep-again")
            r = post(gw, f"/rl/sessions/{episode_id}/end", b"{}", key)
            if attempt == 0:
                assert r.status_code == 200
                continue
            assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
            assert open_sessions(gw) == 0  # closed, not left open for a retry that cannot work
            assert post(gw, f"/rl/sessions/{episode_id}/end").status_code == 200


def test_a_session_nobody_ends_expires_and_is_stored_as_failed(engine, tmp_path):
    for gw in serve(engine, tmp_path, default_max_tokens=4, session_idle_timeout_s=0.5):
        episode_id, key = gw.open_session(task_id="forgotten")
        call(gw, key)
        deadline = time.monotonic() + 60
        while open_sessions(gw) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_sessions(gw) == 0
        stored = gw.store.get(episode_id)
        assert stored.status == "failed" and "idle" in stored.error and len(stored.turns) == 1
        with pytest.raises(openai.AuthenticationError):
            call(gw, key)
        ack = post(gw, f"/rl/sessions/{episode_id}/end", b"{}", key)
        assert ack.status_code == 200 and ack.json()["status"] == "failed"
        assert (
            'areal_gateway_sessions_total{event="expired"} 1.0'
            in httpx.get(gw.base_url + "/metrics").text
        )


def test_ends_that_race_all_answer_the_stored_outcome(gateway):
    import asyncio

    episode_id, key = gateway.open_session()
    call(gateway, key)

    async def end_thrice() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.base_url) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        f"/rl/sessions/{episode_id}/end",
                        json={"reward": float(i)},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    for i in range(3)
                )
            )

    answers = asyncio.run(end_thrice())
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert len({r.text for r in answers}) == 1  # one outcome, the one stored
    assert gateway.store.get(episode_id).reward == answers[0].json()["reward"]


def test_an_end_the_store_refuses_changes_nothing(engine, tmp_path):
    from areal_sdk.gateway import create_app
    from areal_sdk.server_thread import ServerThread
    from areal_sdk.store import TrajectoryStore
    from tests.gateway.conftest import Gateway, gateway_host

    class BusyOnce:
        def __init__(self, store: TrajectoryStore) -> None:
            self.store, self.calls = store, 0

        def append(self, episode) -> None:
            self.calls += 1
            if self.calls == 1:
                raise OSError("disk busy")
            self.store.append(episode)

    store = TrajectoryStore(tmp_path)
    app = create_app(engine, admin_token=ADMIN, episode_sink=BusyOnce(store), host=gateway_host())
    with ServerThread(app, name="gateway") as server:
        gw = Gateway(server.url, ADMIN, store, app)
        episode_id, key = gw.open_session()
        r = post(gw, f"/rl/sessions/{episode_id}/end", b'{"status": "failed", "reward": 1}', key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        episode = gw.episode(episode_id)
        assert episode["status"] == "ok" and episode["reward"] is None and episode["ended"] is None
        call(gw, key)  # not acknowledged: the session goes on
        assert post(gw, f"/rl/sessions/{episode_id}/end", b"{}", key).status_code == 200
    stored = store.get(episode_id)
    assert stored.status == "ok" and stored.reward is None and len(stored.turns) == 1
    store.close()
