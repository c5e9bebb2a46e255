"""Metric sinks (JSON lines, TensorBoard) and the reward-curve plot a run leaves behind.

Sinks register through the ``areal_metric_sinks`` hook like any plugin's; ``run.metric_sinks``
picks them by name and ``run.metric_sink_options.<name>`` passes each its keyword options.
The W&B and MLflow sinks live in ``areal_sdk.wandb_sink`` and ``areal_sdk.mlflow_sink``.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from areal_sdk.hookspecs import hookimpl

if TYPE_CHECKING:
    from areal_sdk.trajectory import Episode

METRICS_FILENAME = "metrics.jsonl"
REWARD_CURVE_FILENAME = "reward_curve.png"
EVAL_FILENAME = "eval.json"


# The columns of a step's sample of trajectories: one row per turn, its ids decoded.
TRAJECTORY_COLUMNS = ("step", "episode", "task", "turn", "prompt", "completion", "reward")


class MetricSink(Protocol):
    """Where step metrics go. Steps count from 1. A sink may also define, and the run calls
    each only where it is defined:

    - ``drop_after(step)``: a resumed run trains the steps after ``step`` again, so what was
      logged for them is forgotten and each step shows once.
    - ``log_config(config)``: the resolved config as nested dicts, once when the run starts.
    - ``log_eval(step, metrics)``: the held-out reward, at step 0 (``eval/before_mean``,
      ``eval/before_sem``) and after the last step (also ``eval/after_*``, ``eval/gain``,
      ``eval/gain_sem``).
    - ``log_trajectories(step, rows)``: a sample of the step's episodes, one dict per turn
      with the keys of ``TRAJECTORY_COLUMNS``.
    """

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

    def drop_after(self, step: int) -> None:
        """Keep the records of steps up to ``step`` (rewritten atomically)."""
        self._file.close()
        kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
        staging = self.path.with_suffix(".jsonl.partial")
        staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
        staging.replace(self.path)
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
        self._log_dir = str(run_dir / "tensorboard")
        self._writer = self._open()

    def _open(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=self._log_dir, purge_step=purge_step)

    def drop_after(self, step: int) -> None:
        """TensorBoard hides the events of steps after ``step`` from earlier files."""
        self._writer.close()
        self._writer = self._open(purge_step=step + 1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if _finite(value) is not None:
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricLogger:
    """Fans each call out to several sinks; the optional methods go to the sinks that have
    them."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    def _each(self, method: str) -> list[Callable[..., None]]:
        return [m for sink in self.sinks if (m := getattr(sink, method, None)) is not None]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def drop_after(self, step: int) -> None:
        """Forget what was logged for steps after ``step``, in every sink that can."""
        for drop in self._each("drop_after"):
            drop(step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for log_config in self._each("log_config"):
            log_config(config)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        for log_eval in self._each("log_eval"):
            log_eval(step, metrics)

    @property
    def keeps_trajectories(self) -> bool:
        """Whether any sink takes trajectory tables (so decoding them is worth it)."""
        return bool(self._each("log_trajectories"))

    def log_trajectories(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        for log_trajectories in self._each("log_trajectories"):
            log_trajectories(step, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sink(
    name: str, factory: Callable[..., MetricSink], run_dir: Path, options: Mapping[str, Any]
) -> MetricSink:
    """``factory(run_dir, **options)``; options it does not take are a ``ValueError`` that
    names them and the ones it takes."""
    check_sink_options(name, factory, options)
    return factory(run_dir, **options)


def check_sink_options(
    name: str, factory: Callable[..., MetricSink], options: Mapping[str, Any]
) -> None:
    try:
        inspect.signature(factory).bind(Path(), **options)
    except TypeError:
        params = inspect.signature(factory).parameters
        known = [p for p, v in params.items() if v.kind == v.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(params))
        raise ValueError(
            f"run.metric_sink_options.{name}: unknown option(s) {', '.join(unknown) or '?'}; "
            f"the {name} sink takes: {', '.join(known) or 'no options'}"
        ) from None


def trajectory_rows(
    step: int, episodes: Sequence[Episode], decode: Callable[[list[int]], str]
) -> list[dict[str, Any]]:
    """One row per turn of ``episodes`` (keys ``TRAJECTORY_COLUMNS``), ids decoded."""
    return [
        {
            "step": step,
            "episode": episode.id,
            "task": episode.task_id,
            "turn": index,
            "prompt": decode(turn.prompt_ids),
            "completion": decode(turn.completion_ids),
            "reward": episode.reward,
        }
        for episode in episodes
        for index, turn in enumerate(episode.turns)
    ]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILENAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _held_out(run_dir: Path) -> dict[str, dict[str, Any]]:
    path = Path(run_dir) / EVAL_FILENAME
    return json.loads(path.read_text()) if path.is_file() else {}


def plot_reward_curve(run_dir: Path, *, key: str = "rollout/reward_mean") -> Path | None:
    """Draw reward against step from ``metrics.jsonl`` into ``reward_curve.png``, with the
    held-out reward before training (at step 0) and after it (at the last step) from
    ``eval.json`` as points with their standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [(r["step"], r[key]) for r in read_metrics(run_dir) if r.get(key) is not None]
    held_out = _held_out(run_dir)
    if not train and not held_out:
        return None
    last = train[-1][0] if train else 0
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="training reward (batch mean)", color="tab:blue")
    for name, x, color in (("before", 0, "tab:gray"), ("after", last, "tab:orange")):
        result = held_out.get(name)
        if result is None or result.get("mean") is None:
            continue
        sem = result.get("sem")
        ax.errorbar(
            [x],
            [result["mean"]],
            yerr=[sem] if sem is not None and math.isfinite(sem) else None,
            fmt="o",
            capsize=4,
            color=color,
            label=f"held-out {name}: {result['mean']:.3f}",
        )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
