"""``train.lora`` against SGLang's LoRA protocol: the trainer's adapter goes by
``/load_lora_adapter`` and every later ``/generate`` names it.

A real SGLang server cannot run here, so the server is a stand-in: the embedded engine's
SGLang routes, plus SGLang's two LoRA routes, which load the adapter directory the way an
adapter-serving engine must (PEFT's layout, on the base model) and serve a request under
the adapter its ``lora_path`` names (refusing one it does not know, as SGLang does).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from areal_sdk.backends.embedded.server import KEEP_ALIVE_S, create_app
from areal_sdk.backends.sglang import SGLangBackend
from areal_sdk.backends.sglang.lora import SGLangLoraSync, lora_server_args
from areal_sdk.backends.train.torch_backend import TorchBackend
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from areal_sdk.config import Config, LoraConfig
from areal_sdk.inference import SamplingParams
from areal_sdk.plugin_host import get_host
from areal_sdk.server_thread import ServerThread
from areal_sdk.training_run import WeightPusher
from tests.backends.embedded.conftest import make_engine
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single

pytest.importorskip("peft")


class LoraStandIn:
    """SGLang's LoRA routes over the embedded engine's SGLang routes."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.engine = make_engine(model_dir)
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}
        self.active: str | None = None
        self.requests: list[str | None] = []  # each /generate's lora_path
        self.routes: list[tuple[str, dict[str, Any]]] = []
        inner = create_app(self.engine)
        app = FastAPI()
        app.post("/load_lora_adapter")(self.load)
        app.post("/unload_lora_adapter")(self.unload)
        app.post("/generate")(self.generate)
        app.mount("/", inner)
        self.app, self.inner = app, inner

    async def load(self, request: Request) -> JSONResponse:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        body = await request.json()
        self.routes.append(("/load_lora_adapter", body))
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, body["lora_path"]).merge_and_unload()
        self.loaded[body["lora_name"]] = {n: p.detach() for n, p in merged.named_parameters()}
        return JSONResponse({"success": True, "loaded_adapters": sorted(self.loaded)})

    async def unload(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.routes.append(("/unload_lora_adapter", body))
        self.loaded.pop(body["lora_name"])
        return JSONResponse({"success": True, "loaded_adapters": sorted(self.loaded)})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        name = body.pop("lora_path", None)
        self.requests.append(name)
        if name is not None and name not in self.loaded:
            return JSONResponse({"error": {"message": f"unknown LoRA {name!r}"}}, 400)
        if name is not None and name != self.active:
            await self.engine.update_weights(self.loaded[name], self.engine.version)
            self.active = name
        transport = httpx.ASGITransport(app=self.inner)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            answer = await client.post("/generate", json=body)
        return Response(answer.content, answer.status_code, media_type="application/json")


@pytest.fixture
def stand_in(tiny_model_dir: Path) -> Iterator[tuple[str, LoraStandIn]]:
    server = LoraStandIn(tiny_model_dir)
    thread = ServerThread(server.app, name="sglang-lora", lifespan="off", keep_alive_s=KEEP_ALIVE_S)
    with thread as running:
        yield running.url, server


async def test_a_push_loads_the_adapter_and_requests_name_it(
    stand_in: tuple[str, LoraStandIn], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, server = stand_in
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "inference": {"backend": "sglang", "urls": [url]},
            "train": {"lora": {"r": 4}, "lr": 1e-2},
            "weights": {"method": "disk", "dir": str(tmp_path / "weights"), "keep_last": 1},
        }
    )
    sglang = SGLangBackend([url], timeout_s=60, retries=1)
    sglang.connect()
    trainer = TorchBackend(tiny_model_dir, cfg.train)
    pusher = WeightPusher(cfg, sglang, trainer, get_host())
    assert isinstance(pusher.sync, SGLangLoraSync)
    batches = micro_batches(10_000)[0]
    try:
        for _ in range(2):
            trainer.train_step(batches, loss_fn(trainer.step))
            await pusher(trainer.version)
        out = await sglang.generate(FIXED_SEQUENCE, SamplingParams(max_new_tokens=4))
    finally:
        await sglang.close()
        await server.engine.close()
    # Version 1's adapter, then version 2's, which replaced it: loaded by path, by name.
    loads = [body for route, body in server.routes if route == "/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["v1", "v2"]
    assert ("/unload_lora_adapter", {"lora_name": "v1"}) in server.routes
    assert Path(loads[-1]["lora_path"]).name == "v000002"
    assert (Path(loads[-1]["lora_path"]) / "adapter_config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000002"]
    # The request named the newest adapter, its tokens carry its version, and their
    # logprobs are the trained policy's.
    assert server.requests == ["v2"] and out.versions == [2] * len(out.output_ids)
    expected = trainer.forward_logprobs([single([*FIXED_SEQUENCE, *out.output_ids])])[0]
    torch.testing.assert_close(
        torch.tensor(out.logprobs), expected[len(FIXED_SEQUENCE) :], atol=1e-4, rtol=0
    )


def test_launched_servers_get_the_lora_flags_the_user_did_not_give() -> None:
    lora = LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    assert lora_server_args(lora, []) == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    ]
    assert lora_server_args(LoraConfig(r=8), ["--max-lora-rank", "64"]) == [
        "--enable-lora",
        "--lora-target-modules",
        "all",
    ]
    assert lora_server_args(None, []) == []
