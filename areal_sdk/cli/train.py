"""``areal-sdk train CONFIG [KEY=VALUE ...] [--resume]``: the main job."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from areal_sdk.cli._common import add_config_arguments, console, fail

if TYPE_CHECKING:
    from areal_sdk.checkpoints import Checkpoint
    from areal_sdk.services.health import ServiceState
    from areal_sdk.training_run import RunResult, TrainingRun

# What a cluster scheduler sends before it kills, and Ctrl-C: both stop the run cleanly.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train the agent's model with asynchronous RL",
        description=(
            "Start the engine, gateway, rollouts and trainer from CONFIG; evaluate on "
            "data.eval_path before and after; write metrics, checkpoints and the reward curve "
            "into run.dir."
        ),
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--resume", action="store_true", help="continue run.dir from its newest checkpoint"
    )
    parser.set_defaults(func=train)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _kept(checkpoint: Checkpoint | None, steps: int) -> str:
    if checkpoint is None or checkpoint.step == 0:
        return "no step trained yet, nothing to checkpoint"
    return f"checkpoint of step {checkpoint.step}/{steps} kept ({checkpoint.path})"


_SERVICE_LABELS = {
    "engine": "engines",
    "gateway": "gateway",
    "rollout_worker": "workers",
    "trainer": "trainer",
}


def _services_up(states: list[ServiceState]) -> str:
    """``engines 2/2  gateway 1/1  workers 1/2  trainer 1/1``: services up of those wanted."""
    from areal_sdk.services.health import count_up

    counts = count_up(states)
    return "  ".join(
        f"{label} {counts[kind][0]}/{counts[kind][1]}"
        for kind, label in _SERVICE_LABELS.items()
        if kind in counts
    )


async def _run_until_signalled(run: TrainingRun) -> RunResult:
    """``run.run()``; a stop signal interrupts it cleanly, a second one at once."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, run.interrupt, sig.name)
    try:
        return await run.run()
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def train(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from areal_sdk.config import ConfigError, load_config
    from areal_sdk.evaluation import gain
    from areal_sdk.models import MaxModelLenError, ModelNotFoundError
    from areal_sdk.tasks import TaskError
    from areal_sdk.trainer import StepReport, TrainingError
    from areal_sdk.training_run import RunError, TrainingRun

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return fail(str(exc))
    progress = Progress(
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    bar = progress.add_task("train", total=cfg.run.steps, stats="waiting for the first batch")

    def on_step(report: StepReport) -> None:
        m = report.metrics
        stats = (
            f"reward {_fmt(m.get('rollout/reward_mean'))}  "
            f"staleness {_fmt(m.get('rollout/staleness_max'), '.0f')}  "
            f"{_fmt(m.get('rollout/tokens_per_s'), '.0f')} tok/s  "
            f"loss {_fmt(m.get('loss'), '.4f')}  v{report.version}"
        )
        if run.placement in ("processes", "ray"):
            stats += "  " + _services_up(run.services())
        progress.update(bar, completed=report.step, stats=stats)
        if not console.is_terminal:
            console.print(f"step {report.step}/{cfg.run.steps}  {stats}", highlight=False)

    def on_event(message: str) -> None:
        progress.console.print(f"[dim]·[/] {escape(message)}", highlight=False)

    try:
        run = TrainingRun(
            cfg,
            config_dir=Path(args.config).resolve().parent,
            resume=args.resume,
            on_step=on_step,
            on_event=on_event,
        )
    except (RunError, TaskError, ModelNotFoundError, MaxModelLenError) as exc:
        return fail(str(exc))
    try:
        with progress:
            result = asyncio.run(_run_until_signalled(run))
    except (
        RunError,
        TaskError,
        ModelNotFoundError,
        MaxModelLenError,
        TrainingError,
        ConfigError,  # one the model decides, e.g. train.lora.target_modules
    ) as exc:
        return fail(str(exc), code=1)
    except (KeyboardInterrupt, asyncio.CancelledError):
        kept = _kept(run.checkpoints.latest(), cfg.run.steps)
        console.print(
            f"stopped at once: the steps since the last checkpoint are lost; {kept}; "
            "continue with --resume",
            highlight=False,
            soft_wrap=True,
        )
        return 130
    if result.interrupted is not None:
        kept = _kept(result.checkpoint, cfg.run.steps)
        console.print(
            f"interrupted by {result.interrupted}: {kept}; continue with --resume",
            highlight=False,
            soft_wrap=True,
        )
        return 128 + signal.Signals[result.interrupted].value
    console.print(
        f"[bold]run[/] {escape(str(result.run_dir))}  steps {result.steps}  version {result.version}"
    )
    if result.before is not None:
        console.print(f"held-out reward before: {result.before}", highlight=False)
    if result.after is not None:
        console.print(f"held-out reward after:  {result.after}", highlight=False)
    if result.before is not None and result.after is not None:
        delta, sem = gain(result.before, result.after)
        console.print(f"gain: {delta:+.3f} ± {sem:.3f}", highlight=False)
    return 0
