"""A fixed little RL batch for the train-backend and weight-sync tests."""

from __future__ import annotations

import math

import torch

from areal_sdk.algorithms.losses import make_loss_fn
from areal_sdk.config import AlgorithmConfig, TrainConfig
from areal_sdk.packing import MicroBatch, pack_samples
from areal_sdk.samples import TrainingSample

# The tiny model's vocabulary is a few hundred tokens; ids stay well inside it.
VOCAB_LIMIT = 300
# A random init is close to uniform over ~347 tokens: behaviour logprobs near log(1/347).
BEHAVIOUR_LP = -math.log(347)
FIXED_SEQUENCE = [5, 17, 42, 99, 7, 3, 250, 12, 64, 128, 33, 8, 91, 200, 15, 4]


def make_samples(n: int = 6, seed: int = 0) -> tuple[list[TrainingSample], list[float]]:
    """``n`` prompt+completion samples of different lengths, with +/- advantages."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = 9 + 3 * i
        ids = torch.randint(0, VOCAB_LIMIT, (length,), generator=g).tolist()
        mask = [0] * 4 + [1] * (length - 4)
        samples.append(
            TrainingSample(
                episode_id=f"e{i}",
                group_id="g0",
                task_id="t0",
                turn_ids=[f"u{i}"],
                input_ids=ids,
                loss_mask=mask,
                logprobs=[BEHAVIOUR_LP if m else 0.0 for m in mask],
                versions=[0 if m else -1 for m in mask],
                reward=float(i % 2),
            )
        )
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return samples, advantages


def micro_batches(max_tokens: int, *, num_ranks: int = 1) -> list[list[MicroBatch]]:
    samples, advantages = make_samples()
    return pack_samples(samples, advantages, max_tokens, num_ranks=num_ranks)


def loss_fn(step: int = 0):
    """GRPO-style decoupled PPO loss, the trainer's default."""
    return make_loss_fn(AlgorithmConfig(), step)


def train_config(**overrides: object) -> TrainConfig:
    return TrainConfig(lr=1e-2, grad_clip=1.0, **overrides)


def single(ids: list[int]) -> MicroBatch:
    """One sequence as a micro-batch (for logprob comparisons)."""
    n = len(ids)
    return MicroBatch(
        input_ids=torch.tensor(ids),
        position_ids=torch.arange(n),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        loss_mask=torch.ones(n),
        behaviour_logprobs=torch.zeros(n),
        versions=torch.zeros(n, dtype=torch.long),
        advantages=torch.zeros(n),
    )
