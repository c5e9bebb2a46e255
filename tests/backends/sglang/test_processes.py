"""Launched server processes: the launcher, the broadcast weight path over gloo, a kill.

``python -m sglang.launch_server`` is a mock here: SGLang cannot run on these machines, so
a fake ``sglang`` package on PYTHONPATH (conftest ``FAKE_LAUNCH_SERVER``) starts the
embedded engine, which serves SGLang's routes, as the server process. Everything else is
real: the launcher's subprocesses, HTTP, and torch.distributed gloo between processes.
The tests share two launched servers and run in file order (the last one kills them).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from areal_sdk.backends.sglang import NoServerLeft, SGLangBackend
from areal_sdk.backends.sglang.weight_sync import SGLangBroadcastSync
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync import make_weight_sync

from areal_sdk.config import Config
from areal_sdk.inference import SamplingParams
from tests.backends.sglang.conftest import launched_servers, launching_config
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config


@pytest.fixture(scope="module")
def launched(
    tiny_model_dir: Path, fake_sglang_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SGLangBackend, Config]]:
    cfg = launching_config(
        tiny_model_dir,
        tmp_path_factory.mktemp("run"),
        sglang_args=["--mem-fraction-static", "0.5"],
        request_timeout_s=60,
        retries=1,
    )
    with launched_servers(cfg, fake_sglang_path) as backend:
        yield backend, cfg


async def test_launcher_starts_servers_keeps_logs_and_serves(launched) -> None:
    backend, cfg = launched
    launcher = backend.launcher
    assert launcher is not None and len(launcher.urls) == 2
    for i, server in enumerate(launcher.servers):
        log = server.log_path.read_text()
        assert server.log_path == Path(cfg.run.dir) / "sglang" / f"server-{i}.log"
        assert "fake sglang.launch_server" in log and f"'base_gpu_id': {i}" in log
        assert server.process.poll() is None
    assert set((await backend.health())["servers"].values()) == {"ok"}
    out = await backend.generate(FIXED_SEQUENCE, SamplingParams(max_new_tokens=5))
    assert len(out.output_ids) == len(out.logprobs) == 5 or out.finish_reason == "stop"


async def _scores(url: str) -> tuple[torch.Tensor, str]:
    body = {
        "input_ids": FIXED_SEQUENCE,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        meta = (await http.post("/generate", json=body)).json()["meta_info"]
    lps = [row[0] or 0.0 for row in meta["input_token_logprobs"]]
    return torch.tensor(lps), meta["weight_version"]


async def test_broadcast_over_gloo_into_every_server_matches_the_trainer(launched) -> None:
    backend, cfg = launched
    sync = make_weight_sync("broadcast", cfg, engine=backend)
    assert isinstance(sync, SGLangBroadcastSync) and sync.backend == "gloo"
    trainer = TorchBackend(Path(cfg.model.path), train_config())
    try:
        for _ in range(2):
            trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
            result = await sync.push(trainer.state_for_sync(32 * 1024), trainer.version)
            assert result is not None and result.version == trainer.version
            assert result.tensors == len(dict(trainer.model.named_parameters()))
            expected = trainer.forward_logprobs([single(FIXED_SEQUENCE)])[0]
            for url in backend.launcher.urls:
                got, version = await _scores(url)
                assert version == str(trainer.version)
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert backend.version == 2
    finally:
        await sync.close()


async def _until_decoding(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        for _ in range(500):
            if (await http.get("/get_load")).json()["num_running_reqs"]:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{url} never started the request")


async def test_a_server_killed_mid_request_is_retried_then_a_clear_error(launched) -> None:
    backend, _ = launched
    launcher = backend.launcher
    long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    task = asyncio.create_task(backend.generate(FIXED_SEQUENCE, long, request_id="ep-k:0"))
    while "ep-k:0" not in backend._where:
        await asyncio.sleep(0.005)
    victim = backend._where["ep-k:0"].url
    await _until_decoding(victim)
    launcher.kill(launcher.urls.index(victim))
    out = await asyncio.wait_for(task, 60)
    survivor = next(u for u in launcher.urls if u != victim)
    assert out.meta["server"] == survivor and len(out.output_ids) == 200
    assert [s.url for s in backend.pool.live] == [survivor]
    # The next turn of that episode follows it to the survivor; then the survivor dies too.
    task = asyncio.create_task(backend.generate(FIXED_SEQUENCE, long, request_id="ep-k:1"))
    await _until_decoding(survivor)
    launcher.kill(launcher.urls.index(survivor))
    with pytest.raises(NoServerLeft) as err:
        await asyncio.wait_for(task, 60)
    assert victim in str(err.value) and survivor in str(err.value)
    assert os.path.exists(launcher.servers[0].log_path)
