"""A request cut short by ``pause(mode=abort)`` for a weight push continues after resume:
real embedded engine, real HTTP on loopback, a real ``cuda_ipc`` push in between."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from areal_sdk.backends.embedded import EmbeddedEngine
from areal_sdk.backends.sglang import SGLangBackend
from areal_sdk.backends.sglang.tensor_sync import SGLangTensorSync
from areal_sdk.backends.train.torch_backend import TorchBackend

from areal_sdk.inference import PauseMode, SamplingParams
from tests.backends.embedded.conftest import full_forward_logprobs
from tests.backends.sglang.test_tensor_sync import trainer_model
from tests.backends.train.common import loss_fn, micro_batches, train_config

PROMPT = [5, 17, 42, 99, 7, 3, 250, 12]
LONG = SamplingParams(max_new_tokens=120, temperature=1.0, ignore_eos=True, seed=3)


async def until_sampled(engine: EmbeddedEngine, tokens: int) -> None:
    """Until a running request of ``engine`` has sampled ``tokens`` tokens."""
    for _ in range(1000):
        if any(len(r.output_ids) >= tokens for r in list(engine._active)):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the request never got going")


async def test_an_abort_pause_for_a_push_continues_the_request_under_the_new_weights(
    backend: SGLangBackend, served: tuple[str, EmbeddedEngine], tiny_model_dir: Path
) -> None:
    _, engine = served
    reference = trainer_model(tiny_model_dir, TorchBackend(tiny_model_dir, train_config()))
    trainer = TorchBackend(tiny_model_dir, train_config())
    trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
    sync = SGLangTensorSync(backend, device="cpu", timeout_s=30)

    task = asyncio.create_task(backend.generate(PROMPT, LONG, request_id="ep-1:0"))
    await until_sampled(engine, 4)
    await backend.pause(PauseMode.ABORT)
    await asyncio.sleep(0.2)
    assert not task.done()  # cut short by the engine, held by the backend
    assert engine.num_running == 0
    await sync.push(trainer.state_for_sync(32 * 1024), trainer.version)
    await backend.resume()
    out = await asyncio.wait_for(task, 60)

    assert out.finish_reason == "length" and len(out.output_ids) == LONG.max_new_tokens
    assert len(out.logprobs) == len(out.versions) == LONG.max_new_tokens
    cut = out.versions.index(1)
    assert 4 <= cut < LONG.max_new_tokens and out.versions == [0] * cut + [1] * (120 - cut)
    assert out.meta["continuations"] == 1 and out.prompt_tokens == len(PROMPT)
    # Each segment's logprobs are its own weights': the initial model before the push, the
    # trainer's after it (the continuation re-reads prompt + partial output under them).
    before = full_forward_logprobs(reference, PROMPT, out.output_ids)
    after = full_forward_logprobs(trainer_model(tiny_model_dir, trainer), PROMPT, out.output_ids)
    expected = before[:cut] + after[cut:]
    torch.testing.assert_close(
        torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-4, rtol=0
    )


async def test_a_callers_abort_still_returns_aborted(
    backend: SGLangBackend, served: tuple[str, EmbeddedEngine]
) -> None:
    _, engine = served
    # Aborted while running: it is not continued, even though a pause follows.
    task = asyncio.create_task(backend.generate(PROMPT, LONG, request_id="ep-2:0"))
    await until_sampled(engine, 2)
    await backend.abort("ep-2:0")
    await backend.pause(PauseMode.ABORT)
    await backend.resume()
    out = await asyncio.wait_for(task, 10)
    assert out.finish_reason == "abort" and 2 <= len(out.output_ids) < LONG.max_new_tokens
    # Aborted while held by a pause: it returns what it sampled before the pause, at once.
    task = asyncio.create_task(backend.generate(PROMPT, LONG, request_id="ep-3:0"))
    await until_sampled(engine, 2)
    await backend.pause(PauseMode.ABORT)
    await asyncio.sleep(0.1)
    await backend.abort("ep-3:0")
    out = await asyncio.wait_for(task, 10)
    assert out.finish_reason == "abort" and 2 <= len(out.output_ids) < LONG.max_new_tokens
    assert out.versions == [0] * len(out.output_ids)
    await backend.resume()
    assert backend._generating == set() and backend._aborted == set()
