"""Metric sinks (JSON lines, TensorBoard) and the reward-curve plot a run leaves behind.

Sinks register through the ``areal_metric_sinks`` hook like any plugin's; ``run.metric_sinks``
picks them by name.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from areal_sdk.hookspecs import hookimpl

METRICS_FILENAME = "metrics.jsonl"
REWARD_CURVE_FILENAME = "reward_curve.png"


class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(value: float) -> float | None:
    return value if isinstance(value, int | float) and math.isfinite(value) else None


class JsonlSink:
    """One JSON object per step in ``run_dir/metrics.jsonl``, flushed at once."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILENAME
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under ``run_dir/tensorboard``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if _finite(value) is not None:
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricLogger:
    """Fans one ``log`` call out to several sinks."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILENAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(run_dir: Path, *, key: str = "rollout/reward_mean") -> Path | None:
    """Draw reward against step from ``metrics.jsonl`` into ``reward_curve.png``.

    Held-out evaluations (``eval/reward_mean``) are drawn as points when present.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    train = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    held_out = [
        (r["step"], r["eval/reward_mean"]) for r in rows if r.get("eval/reward_mean") is not None
    ]
    if not train and not held_out:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="training reward (batch mean)", color="tab:blue")
    if held_out:
        ax.plot(*zip(*held_out, strict=True), "o--", label="held-out reward", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out = Path(run_dir) / REWARD_CURVE_FILENAME
    fig.savefig(out)
    plt.close(fig)
    return out


@hookimpl
def areal_metric_sinks() -> Mapping[str, Callable[[Path], MetricSink]]:
    return {"jsonl": JsonlSink, "tensorboard": TensorBoardSink}
