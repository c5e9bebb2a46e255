"""Live weight updates with per-token versions, pause modes under load, abort by rid."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded import EmbeddedEngine

from areal_sdk.inference import PauseMode, SamplingParams
from tests.backends.embedded.conftest import chat_prompt, full_forward_logprobs, make_engine

LONG = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


def new_weights(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """A visibly different model: every weight perturbed by seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: p.detach().clone() + 0.5 * torch.randn(p.shape, generator=gen) * p.detach().std()
        for name, p in model.named_parameters()
    }


async def started(engine: EmbeddedEngine, prompt: list[int], sampling: SamplingParams, tokens: int):
    """Start a streamed request; return (task gathering all chunks, once it has ``tokens``)."""
    seen = asyncio.Event()
    count = 0

    async def run():
        nonlocal count
        last = None
        async for chunk in engine.stream(prompt, sampling):
            count += len(chunk.ids)
            if count >= tokens:
                seen.set()
            last = chunk
        seen.set()
        return last.output

    task = asyncio.create_task(run())
    await asyncio.wait_for(seen.wait(), 30)
    return task


def prompt_for(engine: EmbeddedEngine, i: int = 0) -> list[int]:
    return chat_prompt(engine.tokenizer, f"Question {i}: a farmer has 3 cows and buys {i} more.")


async def test_update_mid_stream_tags_versions_and_uses_new_weights(
    engine: EmbeddedEngine, reference_model, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = prompt_for(engine)
    tensors = new_weights(reference_model)
    tasks = [await started(engine, prompt_for(engine, i), LONG, 3) for i in range(3)]
    await engine.update_weights(tensors, version=1)
    assert engine.version == 1
    outs = await asyncio.gather(*tasks)
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(tensors, strict=False)
    for i, out in enumerate(outs):
        p = prompt_for(engine, i)
        k = out.versions.index(1)
        assert k >= 3 and out.versions == [0] * k + [1] * (len(out.versions) - k)
        old_ref = full_forward_logprobs(reference_model, p, out.output_ids)
        new_ref = full_forward_logprobs(new_model, p, out.output_ids)
        assert out.logprobs[:k] == pytest.approx(old_ref[:k], abs=1e-4)
        assert out.logprobs[k:] == pytest.approx(new_ref[k:], abs=1e-4)
    # A fresh request now is the new model's greedy output.
    fresh = await engine.generate(
        prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    )
    with torch.no_grad():
        ref = new_model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    assert fresh.output_ids == ref[0, len(prompt) :].tolist() and fresh.versions == [1] * 8


@pytest.mark.parametrize("recompute", [True, False])
async def test_an_update_recomputes_the_running_requests_cache_unless_configured_to_keep_it(
    tiny_model_dir: Path, reference_model, recompute: bool
) -> None:
    engine = make_engine(tiny_model_dir, recompute_kv_on_update=recompute)
    try:
        tasks = [await started(engine, prompt_for(engine, i), LONG, 3) for i in range(3)]
        await engine.pause(PauseMode.IN_PLACE)
        before = engine.stats().prefill_tokens
        await engine.update_weights(new_weights(reference_model), version=1)
        await engine.resume()
        outs = await asyncio.gather(*tasks)
        recomputed = engine.stats().prefill_tokens - before
        for out in outs:  # tokens after the update carry the new version either way
            k = out.versions.index(1)
            assert k >= 3 and out.versions[k:] == [1] * (len(out.versions) - k)
        if recompute:  # every prompt and every token generated before the update, again
            shortest = sum(len(prompt_for(engine, i)) + 2 for i in range(3))
            assert recomputed >= shortest
        else:
            assert recomputed == 0
    finally:
        await engine.close()


async def test_update_from_a_safetensors_directory(
    engine: EmbeddedEngine, reference_model, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    tensors = new_weights(reference_model, seed=2)
    save_file(
        {k: v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"},
        tmp_path / "model.safetensors",
    )
    await engine.update_weights(tmp_path, version=5)
    out = await engine.generate(
        prompt_for(engine), SamplingParams(max_new_tokens=4, temperature=0.0)
    )
    assert out.versions == [5] * len(out.output_ids)
    assert torch.equal(
        engine.model.get_input_embeddings().weight, tensors["model.embed_tokens.weight"]
    )


async def test_bad_weights_are_refused_and_nothing_changes(engine: EmbeddedEngine) -> None:
    from areal_sdk.backends.embedded.weights import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="unknown weight"):
        await engine.update_weights({"no.such.weight": torch.zeros(2)}, version=3)
    with pytest.raises(WeightUpdateError, match="shape"):
        await engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=3)
    assert engine.version == 0
    kept = SamplingParams(max_new_tokens=2, ignore_eos=True)  # a random model may end early
    assert len((await engine.generate([1, 2], kept)).output_ids) == 2


async def test_pause_abort_returns_partial_output(engine: EmbeddedEngine) -> None:
    tasks = [await started(engine, prompt_for(engine, i), LONG, 2) for i in range(4)]
    await engine.pause(PauseMode.ABORT)
    outs = await asyncio.gather(*tasks)
    assert all(o.finish_reason == "abort" and 2 <= len(o.output_ids) < 40 for o in outs)
    # While paused, a new request waits; resume runs it.
    three = SamplingParams(max_new_tokens=3, ignore_eos=True)  # a random model may end early
    waiting = asyncio.create_task(engine.generate([1, 2, 3], three))
    await asyncio.sleep(0.2)
    assert not waiting.done() and engine.num_waiting == 1
    await engine.resume()
    assert len((await waiting).output_ids) == 3


@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.RETRACT])
async def test_pause_keeps_requests_and_resume_finishes_them_unchanged(
    engine: EmbeddedEngine, mode: PauseMode
) -> None:
    refs = [await engine.generate(prompt_for(engine, i), LONG) for i in range(3)]
    tasks = [await started(engine, prompt_for(engine, i), LONG, 2) for i in range(3)]
    await engine.pause(mode)
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in tasks)
    if mode == PauseMode.RETRACT:
        assert engine.num_running == 0 and engine.num_waiting == 3
    else:
        assert engine.num_running == 3
    await engine.resume()
    outs = await asyncio.gather(*tasks)
    for out, ref in zip(outs, refs, strict=True):
        assert out.output_ids == ref.output_ids and out.finish_reason == "length"
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert out.meta["retractions"] == (1 if mode == PauseMode.RETRACT else 0)


async def test_retract_then_update_resumes_on_new_weights(
    engine: EmbeddedEngine, reference_model
) -> None:
    """The refit sequence: pause(retract) -> update -> resume; later tokens carry v1."""
    task = await started(engine, prompt_for(engine), LONG, 3)
    await engine.pause(PauseMode.RETRACT)
    await engine.update_weights(new_weights(reference_model, seed=3), version=1)
    await engine.resume()
    out = await task
    k = out.versions.index(1)
    assert k >= 3 and set(out.versions[k:]) == {1} and len(out.output_ids) == 40


async def test_abort_by_request_id(engine: EmbeddedEngine) -> None:
    seen = asyncio.Event()

    async def watch():
        async for chunk in engine.stream(prompt_for(engine), LONG, request_id="victim"):
            seen.set()
            if chunk.output is not None:
                return chunk.output

    task = asyncio.create_task(watch())
    other = asyncio.create_task(
        engine.generate(prompt_for(engine, 1), SamplingParams(max_new_tokens=6))
    )
    await asyncio.wait_for(seen.wait(), 30)
    await engine.abort("victim")
    out = await task
    assert out.finish_reason == "abort" and out.request_id == "victim" and len(out.output_ids) < 40
    assert (await other).finish_reason in ("stop", "length")
    await engine.abort("unknown-rid")  # no-op
