"""Group-relative advantages: one scalar per sample, compared within its group.

A group is the ``group_size`` episodes run on the same task (``TrainingSample.group_id``).
Three estimators, all critic-free:

- ``grpo``: ``(r - mean_g) / (std_g + eps)`` (DeepSeekMath). ``std_g`` is the population
  standard deviation, so a group of one gets advantage 0 instead of a division by zero.
- ``dr_grpo``: ``r - mean_g`` (Dr. GRPO: no std scaling, which otherwise up-weights groups
  that are almost all right or all wrong).
- ``rloo``: ``r_i - mean_{j != i} r_j`` (REINFORCE leave-one-out), which equals
  ``G / (G - 1) * (r_i - mean_g)``; a group of one gets 0.

>>> group_advantages([1.0, 0.0, 0.0, 1.0], ["a", "a", "a", "a"], "dr_grpo").tolist()
[0.5, -0.5, -0.5, 0.5]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from areal_sdk.samples import TrainingSample

AdvantageMethod = Literal["grpo", "dr_grpo", "rloo"]
GRPO_EPS = 1e-6


def _group_index(group_ids: Sequence[Hashable | None]) -> torch.Tensor:
    """Dense group numbers; ``None`` puts an item in a group of its own."""
    dense: dict[Hashable, int] = {}
    index = []
    for i, gid in enumerate(group_ids):
        key = ("__alone__", i) if gid is None else gid
        index.append(dense.setdefault(key, len(dense)))
    return torch.tensor(index, dtype=torch.long)


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_ids: Sequence[Hashable | None],
    method: AdvantageMethod = "grpo",
    *,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """Advantages [B] float32 for rewards [B], normalised within each group.

    ``group_ids[i]`` names the group of ``rewards[i]`` (any hashable; ``None`` = alone).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() != len(group_ids):
        raise ValueError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    if method not in ("grpo", "dr_grpo", "rloo"):
        raise ValueError(f"unknown advantage method {method!r}; use grpo, dr_grpo or rloo")
    g = _group_index(group_ids)
    n_groups = int(g.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, r)
    mean = (total / count)[g]
    centred = r - mean
    if method == "dr_grpo":
        adv = centred
    elif method == "grpo":
        sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, centred**2)
        std = (sq / count).sqrt()[g]
        adv = centred / (std + eps)
    else:  # rloo
        n = count[g]
        adv = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), torch.zeros_like(r))
    return adv.to(torch.float32)


def _episode_rewards(
    samples: Sequence[TrainingSample],
) -> tuple[list[str], list[float], list[str | None]]:
    """One reward per episode: a split episode yields several samples with the same reward,
    and it must count once in its group's statistics, not once per sample."""
    episodes: dict[str, tuple[float, str | None]] = {}
    for s in samples:
        episodes.setdefault(s.episode_id, (s.reward, s.group_id))
    ids = list(episodes)
    return ids, [episodes[e][0] for e in ids], [episodes[e][1] for e in ids]


def sample_advantages(
    samples: Sequence[TrainingSample], method: AdvantageMethod = "grpo", *, eps: float = GRPO_EPS
) -> list[float]:
    """One advantage per sample, computed over episodes grouped by ``group_id``.

    Samples of the same episode share its advantage; a sample without a group is alone.
    """
    ids, rewards, groups = _episode_rewards(samples)
    adv = group_advantages(rewards, groups, method, eps=eps).tolist()
    by_episode = dict(zip(ids, adv, strict=True))
    return [by_episode[s.episode_id] for s in samples]


def drop_zero_variance_groups(
    samples: Sequence[TrainingSample], *, atol: float = 1e-8
) -> tuple[list[TrainingSample], int]:
    """Keep samples whose group has at least two distinct rewards (DAPO's dynamic sampling).

    A group whose episodes all scored the same has all-zero group-relative advantages and
    only dilutes the batch. Ungrouped samples are kept. Returns (kept, dropped group count).
    """
    _, rewards, groups = _episode_rewards(samples)
    by_group: dict[str, list[float]] = {}
    for reward, gid in zip(rewards, groups, strict=True):
        if gid is not None:
            by_group.setdefault(gid, []).append(reward)
    flat = {gid for gid, rs in by_group.items() if max(rs) - min(rs) <= atol}
    kept = [s for s in samples if s.group_id is None or s.group_id not in flat]
    return kept, len(flat)
