"""Held-out evaluation: the agent over tasks it never trains on, reward mean with its spread."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from areal_sdk.rollout import RolloutController, RolloutSummary
from areal_sdk.trajectory import EpisodeStatus


@dataclass(frozen=True)
class EvalResult:
    """Reward over ``episodes`` held-out episodes; a failed episode counts as reward 0."""

    episodes: int
    failed: int
    mean: float
    sem: float  # standard error of the mean
    seconds: float
    version: int

    def __str__(self) -> str:
        return (
            f"{self.mean:.3f} ± {self.sem:.3f} (standard error, {self.episodes} episodes, "
            f"{self.failed} failed)"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(summary: RolloutSummary, *, version: int) -> EvalResult:
    rewards = [(e.reward or 0.0) if e.status == EpisodeStatus.OK else 0.0 for e in summary.episodes]
    n = len(rewards)
    mean = statistics.fmean(rewards) if rewards else float("nan")
    sem = statistics.stdev(rewards) / math.sqrt(n) if n > 1 else float("nan")
    failed = sum(e.status != EpisodeStatus.OK for e in summary.episodes)
    return EvalResult(n, failed, mean, sem, summary.seconds, version)


async def evaluate(
    controller: RolloutController, tasks: Sequence[dict[str, Any]], *, version: int
) -> EvalResult:
    """Run ``controller`` (its ``group_size`` is the samples per task) over ``tasks``."""
    return summarize(await controller.run(list(tasks)), version=version)


def gain(before: EvalResult, after: EvalResult) -> tuple[float, float]:
    """The reward gain and its standard error (independent samples)."""
    return after.mean - before.mean, math.hypot(before.sem, after.sem)


def held_out_metrics(
    before: EvalResult | None, after: EvalResult | None = None
) -> dict[str, float]:
    """What metric sinks log of the held-out evaluation: ``eval/before_mean``,
    ``eval/before_sem``, the same of ``after``, and ``eval/gain`` with ``eval/gain_sem``
    when both were measured."""
    metrics: dict[str, float] = {}
    for name, result in (("before", before), ("after", after)):
        if result is not None:
            metrics[f"eval/{name}_mean"] = result.mean
            metrics[f"eval/{name}_sem"] = result.sem
    if before is not None and after is not None:
        metrics["eval/gain"], metrics["eval/gain_sem"] = gain(before, after)
    return metrics
