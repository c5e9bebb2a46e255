from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig
from areal_sdk.backends.embedded.server import KEEP_ALIVE_S, create_app

from areal_sdk.server_thread import ServerThread


def make_engine(model_dir: Path, **config: object) -> EmbeddedEngine:
    settings = {"max_batch_size": 8, "max_model_len": 256, "prefill_chunk": 64, **config}
    return EmbeddedEngine.from_pretrained(
        str(model_dir), dtype="float32", config=EngineConfig(**settings)
    )


def engine_server(engine: EmbeddedEngine) -> ServerThread:
    """The engine's SGLang routes on a loopback thread (not started): no lifespan (the app
    has none to run) and the engine's keep-alive, longer than the SGLang client's."""
    return ServerThread(
        create_app(engine), name="engine-http", lifespan="off", keep_alive_s=KEEP_ALIVE_S
    )


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    eng = make_engine(tiny_model_dir)
    yield eng
    await eng.close()


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path):
    """The same weights as a plain transformers model, for full-forward checks."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[tuple[str, EmbeddedEngine]]:
    """A real engine behind a real uvicorn server on 127.0.0.1."""
    eng = make_engine(tiny_model_dir)
    with engine_server(eng) as srv:
        yield srv.url, eng


@pytest.fixture
async def client(server: tuple[str, EmbeddedEngine]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server[0], timeout=60) as c:
        yield c


def full_forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log_softmax(logits)[token] for every completion token, from one forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
