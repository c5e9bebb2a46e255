"""The engine core: continuous batching, KV cache, sampling, stops, logprobs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from areal_sdk.backends.embedded import EmbeddedEngine, EngineInputError

from areal_sdk.inference import PauseMode, SamplingParams
from tests.backends.embedded.conftest import chat_prompt, full_forward_logprobs, make_engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def prompts(engine: EmbeddedEngine, n: int) -> list[list[int]]:
    base = chat_prompt(
        engine.tokenizer, "Natalia sold clips to 48 of her friends in April. How many?"
    )
    # Mixed lengths: each prompt is a different prefix of a long one, some repeated.
    return [base[: 3 + (7 * i) % len(base)] for i in range(n)]


async def test_greedy_matches_hf_generate(engine: EmbeddedEngine, reference_model) -> None:
    prompt = prompts(engine, 4)[3]
    out = await engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0))
    with torch.no_grad():
        ref = reference_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert out.output_ids == ref
    assert out.versions == [0] * len(ref)
    assert out.finish_reason in ("stop", "length")


async def test_logprobs_equal_a_full_forward_pass(engine: EmbeddedEngine, reference_model) -> None:
    prompt = prompts(engine, 6)[5]
    for sampling in (
        SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
    ):
        out = await engine.generate(prompt, sampling)
        ref = full_forward_logprobs(reference_model, prompt, out.output_ids)
        assert out.logprobs == pytest.approx(ref, abs=1e-4)


async def test_temperature_scales_the_logprobs(engine: EmbeddedEngine, reference_model) -> None:
    prompt = prompts(engine, 2)[1]
    out = await engine.generate(
        prompt, SamplingParams(max_new_tokens=6, temperature=0.5, seed=1, top_k=20)
    )
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(reference_model(ids).logits[0].float() / 0.5, dim=-1)
    ref = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.output_ids)]
    assert out.logprobs == pytest.approx(ref, abs=1e-4)


async def test_concurrent_requests_match_running_each_alone(engine: EmbeddedEngine) -> None:
    """32 requests of mixed lengths through 8 slots: continuous batching changes nothing."""
    items = prompts(engine, 32)
    samplings = [
        GREEDY
        if i % 2 == 0
        else SamplingParams(max_new_tokens=4 + i % 5, temperature=0.9, top_p=0.95, seed=i)
        for i in range(32)
    ]
    together = await asyncio.gather(
        *(engine.generate(p, s) for p, s in zip(items, samplings, strict=True))
    )
    for i in (0, 1, 7, 30, 31):
        alone = await engine.generate(items[i], samplings[i])
        assert together[i].output_ids == alone.output_ids
        assert together[i].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert all(
        len(o.output_ids) == s.max_new_tokens for o, s in zip(together, samplings, strict=True)
    )


async def test_seeds_reproduce_and_differ(engine: EmbeddedEngine) -> None:
    prompt = prompts(engine, 3)[2]
    s = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    a = await engine.generate(prompt, s.model_copy(update={"seed": 1}))
    b = await engine.generate(prompt, s.model_copy(update={"seed": 1}))
    c = await engine.generate(prompt, s.model_copy(update={"seed": 2}))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    outs = await engine.generate_n(prompt, s.model_copy(update={"n": 3, "seed": 5}))
    assert len(outs) == 3 and len({tuple(o.output_ids) for o in outs}) > 1


async def test_top_k_one_is_greedy(engine: EmbeddedEngine) -> None:
    prompt = prompts(engine, 4)[3]
    greedy = await engine.generate(prompt, GREEDY)
    top1 = await engine.generate(
        prompt, GREEDY.model_copy(update={"temperature": 1.3, "top_k": 1, "seed": 3})
    )
    assert top1.output_ids == greedy.output_ids


async def test_stop_token_ids_and_strings(engine: EmbeddedEngine) -> None:
    prompt = prompts(engine, 5)[4]
    free = await engine.generate(
        prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    )
    target = free.output_ids[3]
    first = free.output_ids.index(target)
    by_id = await engine.generate(
        prompt,
        SamplingParams(
            max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[target]
        ),
    )
    assert by_id.output_ids == free.output_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.matched_stop == target
    text = engine.tokenizer.decode(free.output_ids[first : first + 2])
    stop = text.strip()[:3] or text
    by_text = await engine.generate(
        prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert by_text.finish_reason == "stop" and by_text.matched_stop == stop
    assert stop in engine.tokenizer.decode(by_text.output_ids)
    assert by_text.output_ids == free.output_ids[: len(by_text.output_ids)]


async def test_eos_stops_unless_ignored(engine: EmbeddedEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    prompt = prompts(engine, 2)[1]
    free = await engine.generate(prompt, GREEDY)
    # Make EOS the argmax after the prompt by stopping on the model's own first token as EOS.
    engine.eos_ids = frozenset({free.output_ids[0], eos})
    stopped = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert stopped.output_ids == free.output_ids[:1] and stopped.finish_reason == "stop"
    ignored = await engine.generate(prompt, GREEDY)
    assert ignored.output_ids == free.output_ids and ignored.finish_reason == "length"


async def test_long_prompt_is_chunked_and_queued(tiny_model_dir) -> None:
    """A prompt longer than one prefill chunk, and more requests than KV slots."""
    eng = make_engine(tiny_model_dir, max_batch_size=2, prefill_chunk=16)
    try:
        long = prompts(eng, 6)[5] * 4
        outs = await asyncio.gather(*(eng.generate(long[: 40 + i], GREEDY) for i in range(5)))
        alone = make_engine(tiny_model_dir, max_batch_size=1, prefill_chunk=256)
        try:
            ref = await alone.generate(long[:44], GREEDY)
        finally:
            await alone.close()
        assert outs[4].output_ids == ref.output_ids
        assert all(o.finish_reason == "length" for o in outs)
    finally:
        await eng.close()


async def test_stats_count_the_steps_rows_and_tokens_of_a_batch(tiny_model_dir) -> None:
    """The loop's counters tell what it did: every sampled token, the prompt tokens fed in
    chunks, and decode batches no larger than the KV slots."""
    eng = make_engine(tiny_model_dir, max_batch_size=4, prefill_chunk=16, reuse_prefixes=False)
    try:
        before = eng.stats()
        batch = [p for p in prompts(eng, 6) if len(p) > 1][:6]
        outs = await asyncio.gather(*(eng.generate(p, GREEDY) for p in batch))
        after = eng.stats()
        sampled = after.sampled_tokens - before.sampled_tokens
        assert sampled == sum(len(o.output_ids) for o in outs) == len(batch) * 8
        # The prompt tokens (no prefix reused) all went through prefill.
        assert after.prefill_tokens - before.prefill_tokens == sum(len(p) for p in batch)
        decode_steps = after.decode_steps - before.decode_steps
        decode_rows = after.decode_rows - before.decode_rows
        assert decode_rows == sampled - len(batch)  # each request's first token is a prefill's
        assert decode_steps <= decode_rows <= 4 * decode_steps
        assert after.steps > before.steps and after.step_s > before.step_s
    finally:
        await eng.close()


async def _trickle(eng: EmbeddedEngine) -> tuple[list[list[int]], int]:
    """One long request decoding, then three prompts submitted one after each of its tokens
    (a trickle of arrivals, as asynchronous rollouts make): their outputs and the prefill
    steps it all took."""
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    batch = prompts(eng, 5)[2:5]
    before = eng.stats().prefill_steps
    stream = eng.stream(prompts(eng, 2)[1], long)
    late: list[asyncio.Task] = []
    async for chunk in stream:
        if chunk.ids and len(late) < len(batch):
            late.append(asyncio.create_task(eng.generate(batch[len(late)], GREEDY)))
    outs = await asyncio.gather(*late)
    return [o.output_ids for o in outs], eng.stats().prefill_steps - before


async def test_prompts_arriving_while_rows_decode_prefill_together(tiny_model_dir) -> None:
    """With ``prompt_hold_steps``, prompts that arrive one step apart wait and prefill in one
    step (one step outside the decode graphs instead of one each), and generate the same."""
    # One prefill step takes all three (no chunking, no prefix shared between them).
    settings = {"max_batch_size": 32, "prefill_chunk": 512, "reuse_prefixes": False}
    held = make_engine(tiny_model_dir, prompt_hold_steps=150, **settings)
    plain = make_engine(tiny_model_dir, prompt_hold_steps=0, **settings)
    try:
        assert held.prompt_hold_steps == 150
        held_outs, held_prefills = await _trickle(held)
        plain_outs, plain_prefills = await _trickle(plain)
        assert held_outs == plain_outs
        assert held_prefills == 2  # the long request's prompt, then the three together
        # Without the hold each prompt prefills when it arrives (two may share a step).
        assert plain_prefills >= 3
    finally:
        await held.close()
        await plain.close()


def test_prompts_are_held_only_where_decode_graphs_run(tiny_model_dir) -> None:
    eng = make_engine(tiny_model_dir)
    assert not eng.runner.graphs_enabled and eng.prompt_hold_steps == 0


async def test_overlapped_decode_generates_what_the_plain_loop_does(tiny_model_dir) -> None:
    """``overlap_decode`` queues each decode step before the host reads the previous one's
    tokens (on CPU the launches run eagerly; the engine's bookkeeping is the same as with
    CUDA graphs): requests that finish by length or stop token mid-batch drop the step that
    rode along, and every output is the plain loop's, token for token."""
    overlapped = make_engine(tiny_model_dir, overlap_decode=True)
    plain = make_engine(tiny_model_dir, overlap_decode=False)
    assert plain.overlap_decode is False and overlapped.overlap_decode is True
    try:
        items = prompts(plain, 12)
        free = await plain.generate(items[5], GREEDY)
        stop = free.output_ids[2]
        samplings = [
            SamplingParams(max_new_tokens=3 + (5 * i) % 11, temperature=0.0, ignore_eos=True)
            for i in range(12)
        ]
        samplings[5] = samplings[5].model_copy(update={"stop_token_ids": [stop]})
        outs = {}
        for eng in (plain, overlapped):
            before = eng.stats()
            outs[eng] = await asyncio.gather(
                *(eng.generate(p, s) for p, s in zip(items, samplings, strict=True))
            )
            sampled = eng.stats().sampled_tokens - before.sampled_tokens
            assert sampled == sum(len(o.output_ids) for o in outs[eng])
        for a, b, s in zip(outs[plain], outs[overlapped], samplings, strict=True):
            assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
            assert len(b.output_ids) == s.max_new_tokens or b.finish_reason == "stop"
        assert outs[overlapped][5].output_ids[-1] == stop
        # A request aborted while its step is in flight ends; the others go on.
        long = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
        stream = overlapped.stream(items[1], long, request_id="gone")
        other = asyncio.create_task(overlapped.generate(items[2], long))
        async for chunk in stream:
            if chunk.ids:
                break
        await stream.aclose()
        assert len((await other).output_ids) == 150
        assert overlapped.num_running == 0
    finally:
        await overlapped.close()
        await plain.close()


async def test_more_slots_than_positions(tiny_model_dir) -> None:
    """Many short requests at once: a decode batch wider than the context length."""
    eng = make_engine(tiny_model_dir, max_batch_size=24, max_model_len=16)
    try:
        batch = [[5 + i, 17, 42] for i in range(20)]
        outs = await asyncio.gather(*(eng.generate(p, GREEDY) for p in batch))
        alone = await eng.generate(batch[7], GREEDY)
        assert all(len(o.output_ids) == 8 for o in outs)
        assert outs[7].output_ids == alone.output_ids
    finally:
        await eng.close()


async def test_a_dead_loop_fails_requests_with_an_ordinary_exception(tiny_model_dir) -> None:
    """Whatever breaks the scheduling loop, even a SystemExit, reaches the callers as an
    exception their event loop can handle, and the engine says it is dead."""
    eng = make_engine(tiny_model_dir)
    try:

        def broken_step() -> None:
            raise SystemExit("simulated crash")

        eng._step = broken_step  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="simulated crash"):
            await eng.generate([5, 17, 42], GREEDY)
        with pytest.raises(RuntimeError, match="loop died"):
            await eng.health()
    finally:
        await eng.close()


async def test_stream_yields_tokens_as_they_come(engine: EmbeddedEngine) -> None:
    prompt = prompts(engine, 2)[1]
    chunks = [c async for c in engine.stream(prompt, GREEDY)]
    assert sum(len(c.ids) for c in chunks) == 8 and len(chunks) >= 2
    assert chunks[-1].output is not None
    assert [t for c in chunks for t in c.ids] == chunks[-1].output.output_ids


@pytest.mark.parametrize(
    ("ids", "sampling", "message"),
    [
        ([], GREEDY, "empty"),
        ([1, 10_000], GREEDY, "outside the vocabulary"),
        ([1] * 300, GREEDY, "context"),
        ([1, 2], SamplingParams(max_new_tokens=255), "max_new_tokens"),
        ([1, 2], SamplingParams(n=2), "generate_n"),
    ],
)
async def test_bad_requests_are_refused_and_engine_keeps_serving(
    engine: EmbeddedEngine, ids: list[int], sampling: SamplingParams, message: str
) -> None:
    with pytest.raises(EngineInputError, match=message):
        await engine.generate(ids, sampling)
    assert len((await engine.generate([1, 2, 3], GREEDY)).output_ids) == 8


async def test_leaving_a_stream_early_aborts_the_request(engine: EmbeddedEngine) -> None:
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    stream = engine.stream(prompts(engine, 2)[1], long, request_id="gone")
    async for chunk in stream:
        if chunk.ids:
            break
    await stream.aclose()
    for _ in range(200):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0
    # The rid is free again.
    out = await engine.generate([1, 2], SamplingParams(max_new_tokens=2), request_id="gone")
    assert out.request_id == "gone"


async def test_top_logprobs_come_from_the_sampled_tokens_distribution(
    engine: EmbeddedEngine, reference_model
) -> None:
    prompt = prompts(engine, 3)[2]
    for temperature in (0.0, 0.7):
        sampling = SamplingParams(
            max_new_tokens=6, temperature=temperature, seed=3, ignore_eos=True, top_logprobs_num=4
        )
        out = await engine.generate(prompt, sampling)
        assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.output_ids)
        ids = torch.tensor([prompt + out.output_ids])
        with torch.no_grad():
            logits = reference_model(ids).logits[0].float()
        lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        for i, top in enumerate(out.top_logprobs):
            ref_lp, ref_ids = lp[len(prompt) - 1 + i].topk(4)
            assert [t for t, _ in top] == ref_ids.tolist()
            assert [v for _, v in top] == pytest.approx(ref_lp.tolist(), abs=1e-4)
            if temperature == 0.0:  # greedy: the sampled token is the best one
                assert top[0] == (out.output_ids[i], pytest.approx(out.logprobs[i], abs=1e-6))


async def test_top_logprobs_only_when_asked_and_per_request(engine: EmbeddedEngine) -> None:
    prompt = prompts(engine, 2)[1]
    plain, two, five = await asyncio.gather(
        engine.generate(prompt, GREEDY),
        engine.generate(prompt, GREEDY.model_copy(update={"top_logprobs_num": 2})),
        engine.generate(prompt, GREEDY.model_copy(update={"top_logprobs_num": 5})),
    )
    assert plain.top_logprobs is None
    assert two.top_logprobs is not None and five.top_logprobs is not None
    assert {len(t) for t in two.top_logprobs} == {2} and {len(t) for t in five.top_logprobs} == {5}
    flat = [pair for top in two.top_logprobs for pair in top]
    assert [pair for top in five.top_logprobs for pair in top[:2]] == [
        (t, pytest.approx(v, abs=1e-4)) for t, v in flat
    ]
    chunks = [
        c async for c in engine.stream(prompt, GREEDY.model_copy(update={"top_logprobs_num": 2}))
    ]
    streamed = [pair for c in chunks for top in c.top_logprobs or [] for pair in top]
    assert streamed == [(t, pytest.approx(v, abs=1e-4)) for t, v in flat]


async def test_generate_after_close_raises(tiny_model_dir) -> None:
    from areal_sdk.backends.embedded.engine import EngineClosedError

    eng = make_engine(tiny_model_dir)
    assert len((await eng.generate([1, 2], GREEDY)).output_ids) == 8
    await eng.close()
    await eng.close()  # twice is fine
    with pytest.raises(EngineClosedError, match="closed"):
        await asyncio.wait_for(eng.generate([1, 2], GREEDY), 5)
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(eng.pause(), 5)
    never_started = make_engine(tiny_model_dir)
    await never_started.close()
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(never_started.generate([1, 2], GREEDY), 5)


@pytest.mark.parametrize("max_len", [16, 127, 128, 1000, 4096])
def test_decode_cache_length_buckets_cover_every_step_at_most_twice_over(max_len: int) -> None:
    """A decode graph attends over its bucket's cache length: every step's longest sequence
    fits in some bucket, and the one chosen reads at most twice what it needs (or 128)."""
    from areal_sdk.backends.embedded.model_runner import kv_len_buckets

    buckets = kv_len_buckets(max_len)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_len + 1
    for needed in range(1, max_len + 2):
        chosen = next(b for b in buckets if b >= needed)
        assert chosen <= max(128, 2 * needed)


async def test_steps_where_nothing_decodes_take_the_larger_prompt_chunk(tiny_model_dir) -> None:
    """A burst of prompts with no request decoding yet (as after a weight push recomputes
    every running request's keys) is fed in ``idle_prefill_chunk`` pieces: fewer steps,
    the same tokens."""
    settings = {"max_batch_size": 8, "prefill_chunk": 16, "reuse_prefixes": False}
    small = make_engine(tiny_model_dir, idle_prefill_chunk=16, **settings)
    large = make_engine(tiny_model_dir, idle_prefill_chunk=512, **settings)
    try:
        batch = [p for p in prompts(small, 8) if len(p) > 8][:6]
        assert sum(len(p) for p in batch) > 4 * 16
        runs = []
        for eng in (small, large):
            # Paused while the burst arrives: a busy machine must not let the first prompt
            # start (and decode) before the others are queued.
            await eng.pause(PauseMode.IN_PLACE)
            before = eng.stats().prefill_steps
            jobs = [asyncio.ensure_future(eng.generate(p, GREEDY)) for p in batch]
            while (await eng.health())["waiting"] < len(batch):
                await asyncio.sleep(0.01)
            await eng.resume()
            outs = await asyncio.gather(*jobs)
            runs.append(([o.output_ids for o in outs], eng.stats().prefill_steps - before))
        (small_ids, small_steps), (large_ids, large_steps) = runs
        assert large_ids == small_ids
        assert large_steps == 1 < small_steps
    finally:
        await small.close()
        await large.close()
