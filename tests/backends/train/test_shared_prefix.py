"""A group's shared prompt packed once: the same tokens trained, the same logprobs, the same
update as each member packed whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train.torch_backend import TorchBackend

from areal_sdk.packing import MicroBatch, pack_samples
from areal_sdk.samples import TrainingSample
from tests.backends.train.common import BEHAVIOUR_LP, FIXED_SEQUENCE, loss_fn, single
from tests.backends.train.common import train_config as base_config


def train_config(**overrides: object):
    return base_config(attn_implementation="varlen", **overrides)


def group(
    prompt: list[int], completions: list[list[int]], group_id: str = "g0", trained_prompt: int = 0
) -> list[TrainingSample]:
    """Samples of one group: ``prompt`` then each completion (the prompt's last
    ``trained_prompt`` tokens marked as sampled, as an earlier turn's reply would be)."""
    out = []
    for i, completion in enumerate(completions):
        ids = prompt + completion
        mask = [0] * (len(prompt) - trained_prompt) + [1] * (trained_prompt + len(completion))
        out.append(
            TrainingSample(
                episode_id=f"{group_id}-e{i}",
                group_id=group_id,
                task_id="t",
                turn_ids=["u"],
                input_ids=ids,
                loss_mask=mask,
                logprobs=[BEHAVIOUR_LP if m else 0.0 for m in mask],
                versions=[0 if m else -1 for m in mask],
                reward=float(i % 2),
            )
        )
    return out


def gsm_like(seed: int = 0, members: int = 6, prompt_len: int = 30) -> list[TrainingSample]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 300, (prompt_len,), generator=g).tolist()
    completions = [
        torch.randint(1, 300, (3 + 2 * i,), generator=g).tolist() for i in range(members)
    ]
    return group(prompt, completions)


def trained_tokens(mb: MicroBatch, values: torch.Tensor) -> dict[int, list[tuple[int, float]]]:
    """Per sample index, its trained tokens and ``values`` at them, in order."""
    bounds = mb.cu_seqlens.tolist()
    parents = [] if mb.parents is None else mb.parents.tolist()
    prefixes = {p for p in parents if p >= 0}
    members = [k for k in range(len(bounds) - 1) if k not in prefixes]
    out = {}
    for k, index in zip(members, mb.sample_indices, strict=True):
        lo, hi = bounds[k], bounds[k + 1]
        keep = mb.loss_mask[lo:hi] > 0
        out[index] = list(
            zip(mb.input_ids[lo:hi][keep].tolist(), values[lo:hi][keep].tolist(), strict=True)
        )
    return out


def test_a_group_s_prompt_is_packed_once_and_each_member_continues_it() -> None:
    samples = gsm_like()
    advantages = [1.0, -1.0] * 3
    (shared,) = pack_samples(samples, advantages, 10_000, share_prefixes=True)
    (whole,) = pack_samples(samples, advantages, 10_000)
    assert len(shared) == len(whole) == 1
    mb = shared[0]
    # The prompt but its last token once, then each member from that token on.
    assert mb.num_tokens == 29 + sum(len(s.input_ids) - 29 for s in samples)
    assert mb.num_tokens < whole[0].num_tokens / 2
    assert mb.parents.tolist() == [-1] + [0] * 6
    assert mb.input_ids[:29].tolist() == samples[0].input_ids[:29]
    bounds = mb.cu_seqlens.tolist()
    for k, index in enumerate(mb.sample_indices, start=1):
        seg = slice(bounds[k], bounds[k + 1])
        assert mb.input_ids[seg].tolist() == samples[index].input_ids[29:]
        assert mb.position_ids[seg].tolist() == list(range(29, len(samples[index].input_ids)))
    # Every trained token, its behaviour logprob and its advantage, as packed whole.
    for name in ("behaviour_logprobs", "advantages", "versions"):
        assert trained_tokens(mb, getattr(mb, name)) == trained_tokens(
            whole[0], getattr(whole[0], name)
        )
    assert mb.loss_mask.sum() == whole[0].loss_mask.sum()


def test_only_tokens_no_member_trained_on_are_shared_and_only_within_a_group() -> None:
    a = group(list(range(1, 21)), [[50, 51], [60, 61, 62]], "a", trained_prompt=5)
    b = group(list(range(1, 21)), [[70, 71]], "b")  # the same prompt, another group
    (batches,) = pack_samples(a + b, [1.0, -1.0, 1.0], 10_000, share_prefixes=True)
    mb = batches[0]
    # Group a shares its first 15 tokens less the last; b's single member shares nothing.
    bounds = mb.cu_seqlens.tolist()
    assert mb.parents.tolist().count(-1) == 2  # a's prefix and b's whole sample
    prefix = mb.parents.tolist().index(-1)
    assert bounds[prefix + 1] - bounds[prefix] == 14
    assert mb.loss_mask.sum() == sum(sum(s.loss_mask) for s in a + b)


def test_a_group_over_the_token_budget_splits_with_the_prompt_in_each_part() -> None:
    samples = gsm_like(members=6, prompt_len=30)
    batches = pack_samples(samples, [1.0] * 6, 45, share_prefixes=True)[0]
    assert len(batches) > 1 and all(mb.num_tokens <= 45 for mb in batches)
    assert sorted(i for mb in batches for i in mb.sample_indices) == list(range(6))
    assert sum(int(mb.loss_mask.sum()) for mb in batches) == sum(sum(s.loss_mask) for s in samples)


def test_shared_prefix_logprobs_and_update_equal_those_of_whole_members(
    tiny_model_dir: Path,
) -> None:
    samples = gsm_like() + gsm_like(seed=1)[:3]
    for k, s in enumerate(samples[6:]):
        s.group_id, s.episode_id = "g1", f"g1-{k}"
    advantages = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 1.0, -1.0, 0.5]
    shared = pack_samples(samples, advantages, 10_000, share_prefixes=True)[0]
    whole = pack_samples(samples, advantages, 10_000)[0]
    assert shared[0].parents is not None and shared[0].num_tokens < whole[0].num_tokens
    one = TorchBackend(_model(tiny_model_dir), train_config())
    two = TorchBackend(_model(tiny_model_dir), train_config())
    got = trained_tokens(shared[0], one.forward_logprobs(shared)[0])
    want = trained_tokens(whole[0], two.forward_logprobs(whole)[0])
    assert got.keys() == want.keys()
    for index in want:
        ids_got, lp_got = zip(*got[index], strict=True)
        ids_want, lp_want = zip(*want[index], strict=True)
        assert ids_got == ids_want
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), atol=1e-5, rtol=0)
    losses = [
        (one.train_step(shared, loss_fn(k))["loss"], two.train_step(whole, loss_fn(k))["loss"])
        for k in range(2)
    ]
    for a, b in losses:
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(
        one.forward_logprobs(probe), two.forward_logprobs(probe), atol=1e-4, rtol=0
    )


def test_shared_prefixes_without_varlen_attention_are_refused(tiny_model_dir: Path) -> None:
    backend = TorchBackend(_model(tiny_model_dir), base_config(attn_implementation="sdpa"))
    batches = pack_samples(gsm_like(), [1.0] * 6, 10_000, share_prefixes=True)[0]
    with pytest.raises(ValueError, match="attn_implementation: varlen"):
        backend.forward_logprobs(batches)


def _model(path: Path) -> Path:
    return path
