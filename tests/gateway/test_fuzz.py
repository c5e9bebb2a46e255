"""Fuzz every route of the gateway's OpenAPI document: no 500, errors in the API's own shape.

Bodies come from each route's request schema (``from_schema`` below covers the JSON Schema
that pydantic writes) and from arbitrary JSON;
the gateway runs on loopback over the real engine, with a small context so that generated
requests that pass validation stay cheap.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import ADMIN, Gateway, serve

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values for a pydantic-written JSON Schema, mostly valid, sometimes at the bounds.

    (hypothesis-jsonschema would do this, but its releases lag Hypothesis' internals.)
    """
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 12)
        return st.text(min_size=lo, max_size=max(lo, min(hi, 12)))
    if kind in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if kind == "integer":
            return st.integers(min_value=lo, max_value=hi)
        return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        lo = schema.get("minItems", 0)
        items = from_schema(schema["items"]) if "items" in schema else JSON
        return st.lists(items, min_size=lo, max_size=lo + 3)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        optional = sorted(set(props) - required)
        return (
            st.fixed_dictionaries(
                {k: from_schema(props[k]) for k in sorted(required)},
                optional={k: from_schema(props[k]) for k in optional},
            )
            if props
            else st.dictionaries(st.text(max_size=6), JSON, max_size=3)
        )
    return JSON


# Message lists that get past the role checks, so calls reach templating and sampling.
_CONTENT = st.text(max_size=12) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "tool_use"])}).map(
        lambda d: {**d, "text": "hi"}
    ),
    max_size=2,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"])},
        optional={"content": _CONTENT, "tool_call_id": st.text(max_size=4)},
    ),
    min_size=1,
    max_size=3,
)

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@pytest.fixture(scope="module")
def fuzz_gateway(engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    path = Path(tmp_path_factory.mktemp("fuzz"))
    yield from serve(engine, path, max_model_len=96, default_max_tokens=4)


@pytest.fixture(scope="module")
def http(fuzz_gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_gateway.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def operations(http: httpx.Client) -> list[tuple[str, str, dict | None]]:
    """(method, path, JSON body schema or None) for every route in /openapi.json."""
    doc = http.get("/openapi.json").json()
    ops = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ops.append((method.upper(), path, body.get("schema")))
    return ops


def check(r: httpx.Response, path: str) -> None:
    assert r.status_code < 500 or r.status_code == 503, (path, r.status_code, r.text[:300])
    if r.status_code < 400:
        return
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text


def test_the_openapi_document_declares_the_bodies(operations):
    declared = {path for _, path, schema in operations if schema is not None}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"} <= declared
    assert {"/rl/sessions", "/rl/sessions/{episode_id}/end"} <= declared


def _call(http: httpx.Client, method: str, path: str, body: object, key: str) -> None:
    url = path.replace("{episode_id}", "ep-none").replace("{model_id}", "gpt-4o")
    headers = {"Authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    content = None if body is None else json.dumps(body)
    if content is not None:
        headers["content-type"] = "application/json"
    with http.stream(method, url, content=content, headers=headers) as r:
        r.read()
    check(r, path)


@FUZZ
@given(data=st.data())
def test_schema_bodies_never_500(http, operations, data):
    method, path, schema = data.draw(st.sampled_from(operations))
    body = data.draw(from_schema(schema)) if schema is not None else None
    if isinstance(body, dict) and "messages" in body and data.draw(st.booleans()):
        body["messages"] = data.draw(MESSAGES)
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep sampling cheap
    _call(http, method, path, body, data.draw(st.sampled_from([ADMIN, "sk-areal-unknown"])))


@FUZZ
@given(data=st.data())
def test_arbitrary_json_never_500(http, operations, data):
    method, path, _ = data.draw(st.sampled_from(operations))
    _call(http, method, path, data.draw(JSON), ADMIN)
