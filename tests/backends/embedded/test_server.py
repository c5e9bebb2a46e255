"""SGLang's native HTTP routes, with SGLang's JSON shapes, over a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from tests.backends.embedded.conftest import chat_prompt

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def sse_events(body: str) -> list[dict | str]:
    out: list[dict | str] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_generate_input_ids_with_logprobs(client: httpx.AsyncClient, server) -> None:
    _, engine = server
    ids = chat_prompt(engine.tokenizer, "What is 2 + 3?")
    r = await client.post(
        "/generate",
        json={"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, "rid": "r1"},
    )
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6
    assert meta["weight_version"] == str(engine.version)
    lps = meta["output_token_logprobs"]
    assert [item[1] for item in lps] == body["output_ids"]
    assert all(isinstance(item[0], float) and item[2] is None for item in lps)
    assert body["text"] == engine.tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    direct = await engine.generate(ids, engine_sampling(GREEDY))
    assert body["output_ids"] == direct.output_ids
    assert [item[0] for item in lps] == pytest.approx(direct.logprobs, abs=1e-5)


async def test_generate_top_logprobs_in_sglang_shape(client: httpx.AsyncClient, server) -> None:
    _, engine = server
    ids = chat_prompt(engine.tokenizer, "What is 2 + 3?")
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True}
    r = await client.post("/generate", json={**body, "top_logprobs_num": 3})
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(meta["output_token_logprobs"])
    for (lp, token, _), top in zip(meta["output_token_logprobs"], tops, strict=True):
        assert len(top) == 3
        assert [row[0] for row in top] == sorted((row[0] for row in top), reverse=True)
        assert top[0][1] == token and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy
    r = await client.post("/generate", json={**body, "top_logprobs_num": 21})
    assert r.status_code == 400 and "top_logprobs_num" in r.json()["error"]["message"]


def engine_sampling(params: dict):
    from areal_sdk.backends.embedded.protocol import parse_sampling

    return parse_sampling(params)[0]


async def test_generate_text_batch_n_and_prompt_logprobs(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate",
        json={
            "text": ["Natalia sold clips", "How many cows"],
            "sampling_params": [GREEDY, {**GREEDY, "temperature": 1.0, "sampling_seed": 3, "n": 2}],
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
        },
    )
    assert r.status_code == 200
    items = r.json()
    assert isinstance(items, list) and len(items) == 3
    first = items[0]["meta_info"]
    assert first["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob
    assert len(first["input_token_logprobs"]) == first["prompt_tokens"]
    assert all(isinstance(item[2], str) for item in first["output_token_logprobs"])


async def test_generate_stream_sse(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate", json={"text": "How many", "sampling_params": GREEDY, "stream": True}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert chunks[0]["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 6
    # Cumulative, as SGLang streams by default.
    assert chunks[-2]["output_ids"] == last["output_ids"][: len(chunks[-2]["output_ids"])]


async def test_stop_string_trims_text_and_reports_match(client: httpx.AsyncClient) -> None:
    free = (
        await client.post("/generate", json={"text": "How many", "sampling_params": GREEDY})
    ).json()
    stop = free["text"][2:4]
    if not stop.strip():
        pytest.skip("the tiny model's greedy text has no printable stop candidate")
    r = await client.post(
        "/generate", json={"text": "How many", "sampling_params": {**GREEDY, "stop": stop}}
    )
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in body["text"] and free["text"].startswith(body["text"])


async def test_pause_continue_abort_and_weight_routes(
    client: httpx.AsyncClient, server, tmp_path: Path
) -> None:
    _, engine = server
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    pending = asyncio.create_task(
        client.post(
            "/generate", json={"input_ids": [1, 2, 3], "sampling_params": long, "rid": "slow"}
        )
    )
    while engine.num_running == 0:
        await asyncio.sleep(0.01)
    r = await client.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = await client.post("/flush_cache")
    assert r.status_code == 400  # requests are running, as in SGLang
    # Refit while paused: write the current weights to disk, load them as version 7.
    save_file(engine.runner.weights(), tmp_path / "model.safetensors")
    r = await client.post(
        "/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "7"}
    )
    assert r.status_code == 200 and r.json()["success"] is True
    assert (await client.get("/get_weight_version")).json() == {"weight_version": "7"}
    paused_at = len(engine._active[0].output_ids)
    r = await client.post("/continue_generation", json={})
    assert r.status_code == 200
    # Let the request decode a few tokens under version 7 before aborting it.
    while all(len(r.output_ids) < paused_at + 3 for r in engine._active):
        await asyncio.sleep(0.005)
    r = await client.post("/abort_request", json={"rid": "slow"})
    assert r.status_code == 200
    body = (await pending).json()
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    versions = body["meta_info"]["output_token_versions"]
    assert versions and versions[-1] == 7 and versions[0] == 0
    r = await client.post("/update_weight_version", json={"new_version": "8"})
    assert r.json()["success"] and engine.version == 8
    r = await client.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200
    await client.post("/continue_generation", json={})
    r = await client.get("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")


async def test_info_and_health_routes(client: httpx.AsyncClient) -> None:
    info = (await client.get("/get_model_info")).json()
    assert {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    } <= set(info)
    assert info["is_generation"] is True
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    load = (await client.get("/get_load")).json()
    assert load["num_reqs"] == 0
    info = (await client.get("/get_server_info")).json()
    assert info["max_running_requests"] == 8
    # The loop's counters travel with the server info and move with each generation.
    sampled = info["stats"]["sampled_tokens"]
    body = {"input_ids": [5, 17, 42], "sampling_params": GREEDY}
    assert (await client.post("/generate", json=body)).status_code == 200
    stats = (await client.get("/get_server_info")).json()["stats"]
    assert stats["sampled_tokens"] == sampled + GREEDY["max_new_tokens"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1] * 300, "sampling_params": GREEDY}, "context"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000}}, "max_new_tokens"),
        (
            {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}},
            "unknown sampling_params key",
        ),
        ({"input_ids": [1, 99999], "sampling_params": GREEDY}, "outside the vocabulary"),
        ({"input_ids": [], "sampling_params": GREEDY}, "empty"),
        ({"text": "", "sampling_params": GREEDY}, "empty"),
        ({"sampling_params": GREEDY}, "exactly one of text or input_ids"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2.0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
        ({"input_ids": [1], "sampling_params": GREEDY, "bogus": 1}, "unknown field 'bogus'"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid has 1 entries"),
    ],
)
async def test_bad_generate_requests_get_400(
    client: httpx.AsyncClient, body: dict, message: str
) -> None:
    r = await client.post("/generate", json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


async def test_malformed_json_and_bad_control_bodies_get_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = await client.post("/pause_generation", json={"mode": "freeze"})
    assert r.status_code == 400
    r = await client.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = await client.post("/abort_request", json={})
    assert r.status_code == 400
    # Still serving.
    r = await client.post("/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY})
    assert r.status_code == 200


async def test_weight_group_routes_refuse_what_they_cannot_serve(client: httpx.AsyncClient) -> None:
    bucket = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]]}
    r = await client.post("/update_weights_from_distributed", json=bucket)
    assert r.status_code == 400 and "no weight group" in r.json()["message"]
    r = await client.post("/destroy_weights_update_group", json={"group_name": "nope"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = await client.post("/init_weights_update_group", json={"master_address": "127.0.0.1"})
    assert r.status_code == 400  # master_port, rank_offset and world_size are required


def test_a_client_that_leaves_aborts_its_generation(server) -> None:
    """As in SGLang: a /generate whose client disconnects stops sampling."""
    import time

    url, engine = server
    before = engine.stats().sampled_tokens
    body = {"input_ids": [5, 17, 42], "sampling_params": {**GREEDY, "max_new_tokens": 240}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/generate", json=body, timeout=0.1)
    deadline = time.monotonic() + 10
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0
    assert engine.stats().sampled_tokens - before < 240
