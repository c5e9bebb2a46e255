"""Packing: budgets, balance across ranks, alignment, and packed forward == separate forward."""

from __future__ import annotations

import pytest
import torch

from areal_sdk.packing import MicroBatch, pack_samples
from areal_sdk.samples import TrainingSample


def _sample(n: int, name: str = "e", first_sampled: bool = False) -> TrainingSample:
    """n tokens: the first half prompt, the rest sampled at version 7 with logprob -0.5."""
    n_prompt = max(1, n // 2)
    mask = [0] * n_prompt + [1] * (n - n_prompt)
    if first_sampled:
        mask[0] = 1
    return TrainingSample(
        episode_id=name,
        group_id="g",
        task_id="t",
        turn_ids=[f"{name}-turn"],
        input_ids=list(range(100, 100 + n)),
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[7 if m else -1 for m in mask],
        reward=1.0,
    )


def _lengths(batches: list[MicroBatch]) -> list[int]:
    return [mb.num_tokens for mb in batches]


def test_tensors_are_aligned_padding_free_and_restart_positions():
    a, b = _sample(4, "a"), _sample(3, "b", first_sampled=True)
    [[mb]] = pack_samples([a, b], [0.5, -1.0], max_tokens=16)
    assert mb.input_ids.tolist() == [100, 101, 102, 103, 100, 101, 102]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 4, 7] and mb.cu_seqlens.dtype == torch.int32
    # b's first token was marked sampled, but nothing predicts it inside the row: mask 0.
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 1]
    assert mb.behaviour_logprobs.tolist() == [0, 0, -0.5, -0.5, 0, -0.5, -0.5]
    assert mb.versions.tolist() == [-1, -1, 7, 7, -1, 7, 7]
    assert mb.advantages.tolist() == [0.5] * 4 + [-1.0] * 3
    assert mb.sample_indices == [0, 1] and mb.seq_lens == [4, 3]
    inputs = mb.model_inputs()
    assert inputs["input_ids"].shape == (1, 7) and inputs["attention_mask"] is None


def test_first_fit_decreasing_uses_the_fewest_micro_batches():
    # 6+4 and 5+3+2 fill two budgets of 10 exactly; even spreading cannot (6+3+2 > 10), so
    # the tight packing is kept rather than spending a third pass.
    samples = [_sample(n, f"s{n}") for n in (3, 6, 2, 5, 4)]
    [rank] = pack_samples(samples, [0.0] * 5, max_tokens=10)
    assert sorted(_lengths(rank)) == [10, 10]
    packed = sorted(i for mb in rank for i in mb.sample_indices)
    assert packed == [0, 1, 2, 3, 4]


def test_micro_batches_are_balanced_when_they_can_be():
    # FFD alone would give 5+5+5+5 = 20 and 4+4+4+4 = 16; spreading gives 18 and 18.
    samples = [_sample(n, f"s{i}") for i, n in enumerate([5, 5, 5, 5, 4, 4, 4, 4])]
    [rank] = pack_samples(samples, [0.0] * 8, max_tokens=20)
    assert _lengths(rank) == [18, 18]


def test_ranks_get_equal_counts_and_similar_tokens():
    lengths = [30, 7, 22, 5, 18, 11, 9, 26, 14, 3, 16, 12]
    samples = [_sample(n, f"s{i}") for i, n in enumerate(lengths)]
    ranks = pack_samples(samples, [0.0] * len(samples), max_tokens=32, num_ranks=3)
    assert len(ranks) == 3
    assert len({len(r) for r in ranks}) == 1
    assert all(n <= 32 for r in ranks for n in _lengths(r))
    totals = [sum(_lengths(r)) for r in ranks]
    assert sum(totals) == sum(lengths)
    assert max(totals) - min(totals) <= 0.1 * sum(lengths) / 3
    packed = sorted(i for r in ranks for mb in r for i in mb.sample_indices)
    assert packed == list(range(len(samples)))


def test_fewer_samples_than_ranks_get_padding_batches():
    ranks = pack_samples([_sample(4, "a"), _sample(6, "b")], [1.0, 1.0], 16, num_ranks=3)
    assert [len(r) for r in ranks] == [1, 1, 1]
    pads = [mb for r in ranks for mb in r if not mb.sample_indices]
    assert len(pads) == 1
    assert pads[0].num_tokens == 1 and pads[0].loss_mask.sum() == 0


def test_sample_over_budget_is_named():
    with pytest.raises(ValueError, match=r"sample 1 \(episode long.*9 tokens.*budget of 8"):
        pack_samples([_sample(4, "short"), _sample(9, "long")], [0.0, 0.0], max_tokens=8)


def test_misaligned_sample_is_an_error():
    bad = _sample(4, "bad")
    bad.logprobs = bad.logprobs[:-1]
    with pytest.raises(ValueError, match=r"episode bad.*logprobs has 3 entries"):
        pack_samples([bad], [0.0], max_tokens=8)


def test_to_moves_every_tensor():
    [[mb]] = pack_samples([_sample(4)], [1.0], max_tokens=8)
    mb.proximal_logprobs = torch.zeros(4)
    moved = mb.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.proximal_logprobs.device.type == "meta"
    assert moved.sample_indices == mb.sample_indices and mb.input_ids.device.type == "cpu"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_each_sequence_alone(tiny_model_dir, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation=attn, dtype=torch.float32
    ).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 1, 5)]
    samples = [
        TrainingSample(
            f"e{i}", "g", "t", ["u"], ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids), 0.0
        )
        for i, ids in enumerate(seqs)
    ]
    [[mb]] = pack_samples(samples, [0.0] * len(samples), max_tokens=64)
    with torch.no_grad():
        packed = model(**mb.model_inputs()).logits[0]
        alone = [model(input_ids=torch.tensor([seqs[i]])).logits[0] for i in mb.sample_indices]
        # Sensitivity: with an all-ones attention mask the restarts are ignored and the later
        # sequences attend to the earlier ones, so their logits change.
        leaky = model(
            **{**mb.model_inputs(), "attention_mask": torch.ones(1, mb.num_tokens)}
        ).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    start = mb.seq_lens[0]
    assert not torch.allclose(leaky[start:], torch.cat(alone)[start:], atol=1e-3)
