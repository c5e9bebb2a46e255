"""RL algorithms as pure functions of tensors: advantages and policy losses.

>>> from areal_sdk.config import AlgorithmConfig
>>> loss_fn = make_loss_fn(AlgorithmConfig(), current_version=3)
"""

from areal_sdk.algorithms.advantages import (
    drop_zero_variance_groups,
    group_advantages,
    sample_advantages,
)
from areal_sdk.algorithms.losses import (
    PPOLossFn,
    aggregate,
    aggregation_weight,
    binary_kl,
    importance_weight,
    k3_kl,
    make_loss_fn,
    metric_values,
    mismatch_keep_mask,
    ppo_clip_loss,
)

__all__ = [
    "PPOLossFn",
    "aggregate",
    "aggregation_weight",
    "binary_kl",
    "drop_zero_variance_groups",
    "group_advantages",
    "importance_weight",
    "k3_kl",
    "make_loss_fn",
    "metric_values",
    "mismatch_keep_mask",
    "ppo_clip_loss",
    "sample_advantages",
]
