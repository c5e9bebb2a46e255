"""JSON that parses but cannot be served (lone surrogates, deep nesting) is the client's error:
a 400 in the route's own error format on every generation route, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import ADMIN

# The JSON escape of a lone UTF-16 surrogate: valid JSON syntax, but no Unicode text.
LONE = rb'"hi \ud800 there"'

ROUTES = {
    "/v1/chat/completions": b'{"model": "m", "max_tokens": 2, "messages": '
    b'[{"role": "user", "content": %s}]}',
    "/v1/responses": b'{"model": "m", "max_output_tokens": 2, "input": %s}',
    "/v1/completions": b'{"model": "m", "max_tokens": 2, "prompt": %s}',
    "/v1/messages": b'{"model": "c", "max_tokens": 2, "messages": '
    b'[{"role": "user", "content": %s}]}',
}


def post(gateway, path: str, body: bytes, key: str = ADMIN) -> httpx.Response:
    return httpx.post(
        gateway.base_url + path,
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


def assert_client_error(path: str, r: httpx.Response) -> str:
    """A 400 in the route's format; returns its message."""
    assert r.status_code == 400, r.text
    body = r.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_lone_surrogate_is_a_400_in_the_routes_format(gateway, path):
    episode_id, key = gateway.open_session()
    message = assert_client_error(path, post(gateway, path, ROUTES[path] % LONE, key))
    assert "surrogate" in message
    # Nothing was recorded, and the session still works with valid text.
    assert gateway.episode(episode_id)["turns"] == []
    ok = post(gateway, path, ROUTES[path] % b'"hi there"', key)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", list(ROUTES))
def test_deeply_nested_json_is_a_400_in_the_routes_format(gateway, path):
    for depth in (200, 100_000):  # under and over the parser's own recursion limit
        nested = b"[" * depth + b"]" * depth
        message = assert_client_error(path, post(gateway, path, ROUTES[path] % nested))
        assert "nest" in message


def test_a_lone_surrogate_in_turn_metadata_is_a_400(gateway):
    _, key = gateway.open_session()
    r = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}", "x-areal-metadata": r'{"tag": "\ud800"}'},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-areal-metadata"
