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


@pytest.mark.parametrize(
    ("arguments", "status"),
    [
        (r'{"a": "\ud800"}', 200),
        ("[" * 150 + "]" * 150, 200),
        ("[" * 100_000 + "]" * 100_000, 400),  # past Python's parser: too long for the model
    ],
)
def test_tool_call_arguments_that_are_no_usable_json_are_kept_as_text(gateway, arguments, status):
    """Arguments are a string to the API: when their JSON is unusable the template gets the
    text as the client sent it, as it does for arguments that are not JSON at all."""
    episode_id, key = gateway.open_session()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    r = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={"model": "m", "max_tokens": 2, "messages": messages},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == status, r.text
    assert len(gateway.episode(episode_id)["turns"]) == (status == 200)
