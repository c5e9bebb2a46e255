"""Training samples built from an episode's turns.

A turn whose prompt extends the previous turn's prompt + completion token for token is merged
into the same sequence: the new prompt tokens (tool results, the template's markers for the
next user message) get loss mask 0, the sampled tokens loss mask 1. Anything else starts a new
sample, and the split is counted in ``MergeStats`` so that a template that breaks
token-exactness shows up in metrics instead of silently doubling the prompt tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from areal_sdk.trajectory import Episode, Turn

# Placeholders for positions the model did not sample (prompt, tool output).
NO_LOGPROB = 0.0
NO_VERSION = -1


@dataclass
class TrainingSample:
    """One token sequence to train on, with per-token behaviour logprobs and versions."""

    episode_id: str
    group_id: str | None
    task_id: str
    turn_ids: list[str]
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int | None:
        sampled = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(sampled) if sampled else None


@dataclass
class MergeStats:
    """How turns became samples. ``splits`` counts turns that could not be merged."""

    turns: int = 0
    merged: int = 0
    splits: int = 0
    split_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, other: MergeStats) -> None:
        self.turns += other.turns
        self.merged += other.merged
        self.splits += other.splits
        for reason, n in other.split_reasons.items():
            self.split_reasons[reason] = self.split_reasons.get(reason, 0) + n

    def as_metrics(self) -> dict[str, float]:
        return {
            "samples/turns": float(self.turns),
            "samples/merged_turns": float(self.merged),
            "samples/merge_failures": float(self.splits),
        }


def _start(episode: Episode, turn: Turn, reward: float) -> TrainingSample:
    n_prompt, n_completion = len(turn.prompt_ids), len(turn.completion_ids)
    return TrainingSample(
        episode_id=episode.id,
        group_id=episode.group_id,
        task_id=episode.task_id,
        turn_ids=[turn.id],
        input_ids=[*turn.prompt_ids, *turn.completion_ids],
        loss_mask=[0] * n_prompt + [1] * n_completion,
        logprobs=[NO_LOGPROB] * n_prompt + list(turn.logprobs),
        versions=[NO_VERSION] * n_prompt + list(turn.versions),
        reward=reward,
    )


def _extend(sample: TrainingSample, turn: Turn) -> None:
    new_prompt = turn.prompt_ids[len(sample.input_ids) :]
    sample.turn_ids.append(turn.id)
    sample.input_ids += [*new_prompt, *turn.completion_ids]
    sample.loss_mask += [0] * len(new_prompt) + [1] * len(turn.completion_ids)
    sample.logprobs += [NO_LOGPROB] * len(new_prompt) + list(turn.logprobs)
    sample.versions += [NO_VERSION] * len(new_prompt) + list(turn.versions)


def _split_reason(sample: TrainingSample, turn: Turn) -> str:
    if len(turn.prompt_ids) < len(sample.input_ids):
        return "prompt_shorter_than_history"
    return "prompt_diverges_from_history"


def episode_reward(episode: Episode) -> float:
    """The scalar a sample trains on: the episode's reward plus any per-turn rewards."""
    turn_rewards = sum(t.reward for t in episode.turns if t.reward is not None)
    return (episode.reward or 0.0) + turn_rewards


def build_samples(
    episode: Episode, *, merge: bool = True, stats: MergeStats | None = None
) -> list[TrainingSample]:
    """Turn an episode into training samples.

    With ``merge=False`` every turn is its own sample. With ``merge=True`` consecutive turns
    are joined whenever the later prompt starts with the earlier sequence exactly.
    """
    stats = stats if stats is not None else MergeStats()
    reward = episode_reward(episode)
    samples: list[TrainingSample] = []
    for turn in episode.turns:
        stats.turns += 1
        current = samples[-1] if samples else None
        if merge and current is not None:
            prefix = turn.prompt_ids[: len(current.input_ids)]
            if prefix == current.input_ids and len(turn.prompt_ids) >= len(current.input_ids):
                _extend(current, turn)
                stats.merged += 1
                continue
            reason = _split_reason(current, turn)
            stats.splits += 1
            stats.split_reasons[reason] = stats.split_reasons.get(reason, 0) + 1
        samples.append(_start(episode, turn, reward))
    return samples


def build_batch_samples(
    episodes: Iterable[Episode], *, merge: bool = True
) -> tuple[list[TrainingSample], MergeStats]:
    stats = MergeStats()
    samples = [s for ep in episodes for s in build_samples(ep, merge=merge, stats=stats)]
    return samples, stats
