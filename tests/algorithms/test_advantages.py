"""Group-relative advantages on numbers checked by hand."""

from __future__ import annotations

import pytest
import torch

from areal_sdk.algorithms import drop_zero_variance_groups, group_advantages, sample_advantages
from areal_sdk.samples import TrainingSample

# Group "a": rewards 1, 0, 0, 1 (mean 0.5, population std 0.5).
# Group "b": rewards 2, 4 (mean 3, population std 1).
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0]
GROUPS = ["a", "a", "a", "a", "b", "b"]


def test_grpo_divides_by_the_group_std():
    # a: (1 - 0.5) / 0.5 = 1, (0 - 0.5) / 0.5 = -1;  b: (2 - 3) / 1 = -1, (4 - 3) / 1 = 1
    adv = group_advantages(REWARDS, GROUPS, "grpo")
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([1, -1, -1, 1, -1, 1], abs=1e-5)


def test_dr_grpo_only_centres():
    # a: 1 - 0.5 = 0.5, 0 - 0.5 = -0.5;  b: 2 - 3 = -1, 4 - 3 = 1
    adv = group_advantages(REWARDS, GROUPS, "dr_grpo")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -1, 1])


def test_rloo_subtracts_the_mean_of_the_others():
    # a, item 0: 1 - (0 + 0 + 1) / 3 = 2/3;  item 1: 0 - (1 + 0 + 1) / 3 = -2/3
    # b: 2 - 4 = -2, 4 - 2 = 2
    adv = group_advantages(REWARDS, GROUPS, "rloo")
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2, 2])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_an_item_without_group_gets_zero(method):
    # A group of one has nothing to compare against: mean = its reward, advantage 0.
    adv = group_advantages([5.0, 1.0, 3.0], [None, "g", "g"], method)
    assert adv[0].item() == 0.0
    assert adv[1].item() == pytest.approx(-adv[2].item())


def test_equal_rewards_give_zero_not_nan():
    # std 0: (r - mean) / (0 + eps) = 0 / eps = 0
    adv = group_advantages([1.0, 1.0, 1.0], ["g", "g", "g"], "grpo")
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_unknown_method_and_length_mismatch_are_errors():
    with pytest.raises(ValueError, match="unknown advantage method"):
        group_advantages([1.0], ["g"], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 rewards but 1 group ids"):
        group_advantages([1.0, 2.0], ["g"])


def _sample(episode: str, group: str | None, reward: float) -> TrainingSample:
    return TrainingSample(
        episode, group, "task", ["t"], [1, 2], [0, 1], [0.0, -1.0], [-1, 0], reward
    )


def test_a_split_episode_counts_once_in_its_group():
    # Episode e1 (reward 1) was split into two samples, e2 scored 0; one group.
    # Per episode: mean 0.5 -> e1 +0.5, e2 -0.5. Counting samples would give mean 2/3.
    samples = [_sample("e1", "g", 1.0), _sample("e1", "g", 1.0), _sample("e2", "g", 0.0)]
    assert sample_advantages(samples, "dr_grpo") == pytest.approx([0.5, 0.5, -0.5])


def test_drop_zero_variance_groups_keeps_informative_and_ungrouped():
    samples = [
        _sample("e1", "flat", 1.0),
        _sample("e2", "flat", 1.0),
        _sample("e3", "mixed", 1.0),
        _sample("e4", "mixed", 0.0),
        _sample("e5", None, 1.0),
    ]
    kept, dropped = drop_zero_variance_groups(samples)
    assert [s.episode_id for s in kept] == ["e3", "e4", "e5"]
    assert dropped == 1
