"""Bad requests get the API's own error JSON with the right status, never a stack trace."""

from __future__ import annotations

import socket

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from areal_sdk.gateway import create_app
from areal_sdk.inference import GenerateOutput, InferenceBackend, PauseMode, SamplingParams
from areal_sdk.server_thread import ServerThread
from tests.gateway.conftest import ADMIN, gateway_host, serve

ASK = [{"role": "user", "content": "hi"}]


def post(gateway, path, body, key=ADMIN, **kw):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        return httpx.post(gateway.base_url + path, content=body, headers=headers, **kw)
    return httpx.post(gateway.base_url + path, json=body, headers=headers, **kw)


def assert_openai_error(r, status, *, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def assert_anthropic_error(r, status, kind):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]


def test_malformed_json(gateway):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert_openai_error(post(gateway, path, b"{not json"), 400, code="invalid_json")
    assert_anthropic_error(post(gateway, "/v1/messages", b"[1,"), 400, "invalid_request_error")


def test_schema_violations_name_the_parameter(gateway):
    assert_openai_error(
        post(gateway, "/v1/chat/completions", {"model": "m"}), 400, param="messages"
    )
    assert_openai_error(
        post(gateway, "/v1/chat/completions", {"model": "m", "messages": ASK, "temperature": 5}),
        400,
        param="temperature",
    )
    assert_openai_error(
        post(
            gateway,
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
        ),
        400,
        param="messages[0].role",
    )
    err = assert_openai_error(
        post(gateway, "/v1/chat/completions", {"model": "m", "messages": ASK, "frobnicate": 1}),
        400,
        param="frobnicate",
        code="unknown_parameter",
    )
    assert "frobnicate" in err["message"]
    e = assert_anthropic_error(
        post(gateway, "/v1/messages", {"model": "c", "messages": ASK}), 400, "invalid_request_error"
    )
    assert "max_tokens" in e["message"]


def test_unsupported_parameters_are_named(gateway):
    c = OpenAI(base_url=gateway.base_url + "/v1", api_key=ADMIN, max_retries=0)
    for kwargs, param in [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=ASK, **kwargs)
        assert err.value.body["param"] == param and param in err.value.body["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_openai_error(
        post(gateway, "/v1/chat/completions", {"model": "m", "messages": image}),
        400,
        param="messages[0].content[0].type",
    )
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=ADMIN, max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(
            model="c",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )


def test_context_overflow_reports_token_counts(gateway):
    long = [{"role": "user", "content": "seven " * 2000}]
    err = assert_openai_error(
        post(gateway, "/v1/chat/completions", {"model": "m", "messages": long}),
        400,
        code="context_length_exceeded",
    )
    assert "1024" in err["message"] and "in the messages" in err["message"]
    err = assert_openai_error(
        post(gateway, "/v1/chat/completions", {"model": "m", "messages": ASK, "max_tokens": 5000}),
        400,
        code="context_length_exceeded",
    )
    assert "5000 in the completion" in err["message"]
    assert_anthropic_error(
        post(gateway, "/v1/messages", {"model": "c", "max_tokens": 5000, "messages": ASK}),
        400,
        "invalid_request_error",
    )


def test_unknown_routes_and_methods(gateway):
    assert_openai_error(httpx.get(gateway.base_url + "/v1/nope"), 404, code="not_found")
    assert_openai_error(httpx.get(gateway.base_url + "/v1/chat/completions"), 405)
    assert_anthropic_error(httpx.get(gateway.base_url + "/v1/messages"), 405, "api_error")


def test_body_over_the_limit_is_413(engine, tmp_path):
    for gw in serve(engine, tmp_path, max_body_bytes=2000):
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
        assert_openai_error(post(gw, "/v1/chat/completions", big), 413, code="request_too_large")
        assert_anthropic_error(
            post(gw, "/v1/messages", {**big, "max_tokens": 3}), 413, "request_too_large"
        )

        def chunks():
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}]}'

        r = httpx.post(
            gw.base_url + "/v1/chat/completions",
            content=chunks(),
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert_openai_error(r, 413)


class RemoteEngine(InferenceBackend):
    """A client of an engine server that is not running: every call gets connection refused."""

    def __init__(self, url: str, tokenizer) -> None:
        self.url = url
        self.tokenizer = tokenizer

    @property
    def version(self) -> int:
        return 0

    async def generate(
        self, input_ids, sampling: SamplingParams, *, request_id=None
    ) -> GenerateOutput:
        async with httpx.AsyncClient() as http:
            r = await http.post(self.url + "/generate", json={"input_ids": input_ids})
        raise AssertionError(f"unexpected answer {r.status_code}")

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None: ...
    async def resume(self) -> None: ...
    async def abort(self, request_id: str) -> None: ...
    async def update_weights(self, source, version: int) -> None: ...

    async def health(self):
        async with httpx.AsyncClient() as http:
            await http.get(self.url + "/health")
        return {}


def test_engine_down_is_503(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again on exit: nothing listens there
    app = create_app(
        RemoteEngine(f"http://127.0.0.1:{port}", engine.tokenizer),
        admin_token=ADMIN,
        host=gateway_host(),
    )
    with ServerThread(app, name="gateway") as server:
        c = OpenAI(base_url=server.url + "/v1", api_key=ADMIN, max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            c.chat.completions.create(model="m", messages=ASK, max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "engine_unavailable"
        a = anthropic.Anthropic(base_url=server.url, api_key=ADMIN, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as aerr:
            a.messages.create(model="c", max_tokens=2, messages=ASK)
        assert aerr.value.status_code == 503
        assert httpx.get(server.url + "/health").status_code == 503
