"""Prompt prefixes computed once: a group's members, an agent's next turn, after an update."""

from __future__ import annotations

import asyncio

import torch
from areal_sdk.backends.embedded import EmbeddedEngine
from areal_sdk.backends.embedded.prefix_reuse import MIN_REUSE_TOKENS, common_prefix

from areal_sdk.inference import SamplingParams
from tests.backends.embedded.conftest import chat_prompt, full_forward_logprobs, make_engine
from tests.backends.embedded.test_weights_and_pause import new_weights

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)


def prompt(
    engine: EmbeddedEngine,
    question: str = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?",
) -> list[int]:
    return chat_prompt(engine.tokenizer, question)


def test_common_prefix_is_exact_and_bounded() -> None:
    a = list(range(100))
    assert common_prefix(a, a, 99) == 99
    assert common_prefix(a, a[:40] + [-1] * 60, 99) == 40
    assert common_prefix(a, [-1, *a[1:]], 99) == 0
    assert common_prefix(a[:10], a, 99) == 10


async def test_a_group_sent_together_prefills_its_prompt_once(
    tiny_model_dir, reference_model
) -> None:
    """Eight members of a GRPO group at once: one prefill, seven copies, and every member's
    logprobs those of a full forward pass over its own tokens."""
    eng = make_engine(tiny_model_dir, max_batch_size=8)
    try:
        ids = prompt(eng)
        assert len(ids) > 2 * MIN_REUSE_TOKENS
        before = eng.stats()
        outs = await asyncio.gather(*(eng.generate(ids, SAMPLED) for _ in range(8)))
        after = eng.stats()
        reused = after.reused_tokens - before.reused_tokens
        prefilled = after.prefill_tokens - before.prefill_tokens
        assert reused == 7 * (len(ids) - 1)
        assert prefilled + reused + 7 == 8 * len(ids)  # 7 last prompt tokens fed by decode
        for out in outs:
            ref = full_forward_logprobs(reference_model, ids, out.output_ids)
            torch.testing.assert_close(
                torch.tensor(out.logprobs), torch.tensor(ref), atol=1e-4, rtol=0
            )
    finally:
        await eng.close()


async def test_an_agent_s_next_turn_reuses_the_conversation_from_the_freed_slot(
    tiny_model_dir,
) -> None:
    reusing = make_engine(tiny_model_dir, max_batch_size=2)
    fresh = make_engine(tiny_model_dir, max_batch_size=2, reuse_prefixes=False)
    try:
        first = prompt(reusing)
        turn = await reusing.generate(first, GREEDY)
        second = first + turn.output_ids + prompt(reusing, "And in May?")[1:]
        before = reusing.stats()
        got = await reusing.generate(second, GREEDY)
        reused = reusing.stats().reused_tokens - before.reused_tokens
        # Everything the first turn computed: its prompt and all but its last output token.
        assert reused == len(first) + len(turn.output_ids) - 1
        want = await fresh.generate(second, GREEDY)
        assert got.output_ids == want.output_ids
        assert got.logprobs == want.logprobs or torch.allclose(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5
        )
    finally:
        await reusing.close()
        await fresh.close()


async def test_no_cache_of_older_weights_is_reused(tiny_model_dir, reference_model) -> None:
    reusing = make_engine(tiny_model_dir, max_batch_size=2)
    fresh = make_engine(tiny_model_dir, max_batch_size=2, reuse_prefixes=False)
    try:
        ids = prompt(reusing)
        await reusing.generate(ids, GREEDY)
        new = new_weights(reference_model)
        for engine in (reusing, fresh):
            await engine.update_weights(new, version=1)
        before = reusing.stats().reused_tokens
        got = await reusing.generate(ids, GREEDY)
        assert reusing.stats().reused_tokens == before
        want = await fresh.generate(ids, GREEDY)
        assert got.output_ids == want.output_ids
    finally:
        await reusing.close()
        await fresh.close()
