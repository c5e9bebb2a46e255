"""The SGLang client against the embedded engine's SGLang routes, over real HTTP."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.sglang import NoServerLeft, SGLangBackend
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync import make_weight_sync
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_sdk.config import Config
from areal_sdk.inference import PauseMode, SamplingParams
from areal_sdk.plugin_host import get_host
from tests.backends.embedded.conftest import engine_server, full_forward_logprobs, make_engine
from tests.backends.train.common import loss_fn, micro_batches, train_config

PROMPT = [5, 17, 42, 99, 7, 3, 250, 12]
LONG = SamplingParams(max_new_tokens=48, temperature=1.0, ignore_eos=True, seed=1)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again on exit: nothing listens there
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def backend(servers, tiny_model_dir: Path) -> AsyncIterator[SGLangBackend]:
    b = SGLangBackend(
        [url for url, _ in servers],
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
        timeout_s=60,
        retries=1,
    )
    b.connect()
    yield b
    await b.close()


async def test_generate_returns_the_engines_tokens_logprobs_and_versions(
    backend: SGLangBackend, tiny_model_dir: Path
) -> None:
    out = await backend.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0))
    n = len(out.output_ids)
    assert 0 < n <= 12 and len(out.logprobs) == len(out.versions) == n
    assert out.finish_reason in ("stop", "length") and out.versions == [0] * n
    assert (
        out.prompt_tokens == len(PROMPT)
        and out.meta["server"] in backend.pool.servers[0].url + backend.pool.servers[1].url
    )
    # The logprobs are the model's own, token-exactly: one full forward agrees.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = full_forward_logprobs(model, PROMPT, out.output_ids)
    torch.testing.assert_close(
        torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-4, rtol=0
    )


async def test_top_logprobs_travel_through_the_sglang_protocol(backend: SGLangBackend) -> None:
    out = await backend.generate(
        PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0, top_logprobs_num=4)
    )
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.output_ids)
    for (token, logprob), top in zip(
        zip(out.output_ids, out.logprobs, strict=True), out.top_logprobs, strict=True
    ):
        assert len(top) == 4 and top[0][0] == token  # greedy: the sampled token is the argmax
        assert top[0][1] == pytest.approx(logprob, abs=1e-5)


async def test_an_episode_sticks_to_its_server_and_episodes_spread(
    backend: SGLangBackend,
) -> None:
    one = SamplingParams(max_new_tokens=4)
    first = await asyncio.gather(
        backend.generate(PROMPT, one, request_id="ep-a:0"),
        backend.generate(PROMPT, one, request_id="ep-b:0"),
    )
    assert first[0].meta["server"] != first[1].meta["server"]
    for turn in range(1, 4):
        later = await asyncio.gather(
            backend.generate(PROMPT, one, request_id=f"ep-b:{turn}"),
            backend.generate(PROMPT, one, request_id=f"ep-a:{turn}"),
        )
        assert [o.meta["server"] for o in later] == [
            first[1].meta["server"],
            first[0].meta["server"],
        ]


async def _until_running(servers, n: int) -> None:
    for _ in range(500):
        if sum(eng.num_running for _, eng in servers) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests never started")


async def test_pause_and_resume_under_load(backend: SGLangBackend, servers) -> None:
    # retract: six requests in flight stay in flight while paused, and finish after resume.
    tasks = [asyncio.create_task(backend.generate(PROMPT, LONG)) for _ in range(6)]
    await _until_running(servers, 6)
    await backend.pause(PauseMode.RETRACT)
    held = asyncio.create_task(backend.generate(PROMPT, SamplingParams(max_new_tokens=2)))
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in [*tasks, held])
    assert all(eng.num_running == 0 for _, eng in servers)  # retracted: nothing decodes
    await backend.resume()
    outs = await asyncio.wait_for(asyncio.gather(*tasks, held), 60)
    assert all(o.finish_reason == "length" and len(o.output_ids) == 48 for o in outs[:6])
    # abort: the engines end in-flight requests at once; the backend holds their partial
    # output and continues them after resume.
    tasks = [asyncio.create_task(backend.generate(PROMPT, LONG)) for _ in range(6)]
    await _until_running(servers, 6)
    await backend.pause(PauseMode.ABORT)
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in tasks)
    assert all(eng.num_running == 0 for _, eng in servers)
    await backend.resume()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(o.finish_reason == "length" and len(o.output_ids) == 48 for o in outs)
    assert all(len(o.logprobs) == len(o.versions) == len(o.output_ids) for o in outs)
    assert (await backend.generate(PROMPT, SamplingParams(max_new_tokens=3))).output_ids


async def test_abort_one_request(backend: SGLangBackend, servers) -> None:
    long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    task = asyncio.create_task(backend.generate(PROMPT, long, request_id="ep-x:0"))
    await _until_running(servers, 1)
    await backend.abort("ep-x:0")
    out = await asyncio.wait_for(task, 10)
    assert out.finish_reason == "abort" and len(out.output_ids) < 200


async def test_disk_weight_update_while_requests_are_in_flight(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engines = [make_engine(tiny_model_dir, max_model_len=1024) for _ in range(2)]
    threads = [engine_server(e) for e in engines]
    for t in threads:
        t.start()
    backend = SGLangBackend([t.url for t in threads], timeout_s=60)
    try:
        backend.connect()
        cfg = Config.model_validate(
            {"model": {"path": str(tiny_model_dir)}, "run": {"dir": str(tmp_path)}}
        )
        sync = make_weight_sync("disk", cfg, engine=backend)
        trainer = TorchBackend(tiny_model_dir, train_config())
        trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
        # Long enough to still be decoding when the push lands, on a fast or a busy machine.
        long = SamplingParams(max_new_tokens=1000, temperature=1.0, ignore_eos=True)
        tasks = [asyncio.create_task(backend.generate(PROMPT, long)) for _ in range(4)]
        await _until_running([(t.url, e) for t, e in zip(threads, engines, strict=True)], 4)
        await asyncio.sleep(0.2)
        result = await sync.push(trainer.state_for_sync(32 * 1024), trainer.version)
        assert result is not None and backend.version == trainer.version == 1
        assert [e.version for e in engines] == [1, 1]
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for out in outs:  # tokens sampled before the update carry 0, after it 1
            assert out.versions[0] == 0 and out.versions[-1] == 1
            assert out.versions == sorted(out.versions)
        assert (tmp_path / "weights" / "v000001" / "config.json").is_file()
    finally:
        await backend.close()
        for t in threads:
            t.stop()
        for e in engines:
            await e.close()


async def test_no_server_left_is_a_clear_error_naming_the_server(servers) -> None:
    gone = dead_url()
    with pytest.raises(NoServerLeft, match=gone.replace(".", r"\.")):
        SGLangBackend([gone], retries=0).connect()
    # One dead among live ones: it leaves rotation, the live one serves.
    backend = SGLangBackend([gone, servers[0][0]], retries=0)
    backend.connect()
    assert [s.url for s in backend.pool.live] == [servers[0][0]]
    out = await backend.generate(PROMPT, SamplingParams(max_new_tokens=2))
    assert out.meta["server"] == servers[0][0]
    health = await backend.health()
    assert health["servers"][servers[0][0]] == "ok" and health["servers"][gone] != "ok"
    await backend.close()


async def test_the_plugin_host_builds_it_from_config(servers, tiny_model_dir: Path) -> None:
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "inference": {"backend": "sglang", "urls": [servers[1][0]], "retries": 1},
        }
    )
    backend = get_host().inference_backend("sglang")(cfg)
    try:
        assert isinstance(backend, SGLangBackend) and backend.tokenizer is not None
        assert (await backend.health())["status"] == "ok"
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await backend.generate([10**6], SamplingParams(max_new_tokens=2))
    finally:
        await backend.close()


async def test_a_dropped_request_on_a_healthy_server_fails_alone(servers) -> None:
    """A connection the server drops mid-request (while /health still answers) fails that
    request only: the server stays in rotation and serves the next one."""
    upstream = servers[0][0]
    dropped: list[str] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # One request per connection: forward it to the real server, except the first
        # /generate, whose connection is closed unanswered.
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        body = await reader.readexactly(length)
        if head.startswith(b"POST /generate") and not dropped:
            dropped.append("generate")
            writer.close()
            return
        host, port = upstream.removeprefix("http://").split(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.write(head.replace(b"keep-alive", b"close") + body)
        await up_writer.drain()
        writer.write(await up_reader.read())
        await writer.drain()
        writer.close()
        up_writer.close()

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    backend = SGLangBackend([url], retries=0)
    try:
        await asyncio.to_thread(backend.connect)  # blocking; the relay runs on this loop
        with pytest.raises(ConnectionError, match="unavailable"):
            await backend.generate(PROMPT, SamplingParams(max_new_tokens=2))
        assert dropped and [s.url for s in backend.pool.live] == [url]
        out = await backend.generate(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert len(out.output_ids) == 2
    finally:
        await backend.close()
        proxy.close()
