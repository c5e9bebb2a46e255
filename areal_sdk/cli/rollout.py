"""``areal-sdk rollout CONFIG [KEY=VALUE ...]``: run the agent over tasks, store episodes."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from areal_sdk.cli._common import add_config_arguments, console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rollout",
        help="run the agent over data.path and store its episodes (no training)",
        description=(
            "Start the engine and gateway from CONFIG, run agent.entry over the tasks in "
            "data.path (rollout.group_size samples each), store every episode in run.dir and "
            "print the reward with its spread."
        ),
    )
    add_config_arguments(parser)
    parser.add_argument("--run-id", default="rollout", help="the run id episodes are stored under")
    parser.set_defaults(func=rollout)


async def _rollout(cfg, config_dir: Path, run_id: str, progress, bar):  # type: ignore[no-untyped-def]
    from areal_sdk.evaluation import summarize
    from areal_sdk.launcher import LocalStack, open_agent
    from areal_sdk.plugin_host import get_host
    from areal_sdk.rollout import RolloutController
    from areal_sdk.store import TrajectoryStore
    from areal_sdk.tasks import load_tasks
    from areal_sdk.trajectory_export import record_run_config

    tasks = load_tasks(cfg.data.path, id_field=cfg.data.id_field, limit=cfg.data.limit)
    progress.update(bar, total=len(tasks) * cfg.rollout.group_size)
    host = get_host()
    # The agent first, before any model loads: a missing extra fails in seconds.
    address, agent = open_agent(cfg, host, search_path=[config_dir, Path.cwd()])
    try:
        store = TrajectoryStore(cfg.run.dir, run_id=run_id)
        record_run_config(cfg)  # so `trajectories export` decodes with the run's tokenizer
    except BaseException:
        address.close()
        raise
    stack = LocalStack(cfg, store, host=host, address=address)
    try:
        await asyncio.to_thread(stack.start)
        sessions = stack.sessions(run_id)
        controller = RolloutController.from_config(cfg, agent, sessions, host=host)
        summary = await controller.run(tasks, progress=lambda _e: progress.advance(bar))
    finally:
        await asyncio.to_thread(stack.stop)
        store.close()
    return summary, summarize(summary, version=0)


def rollout(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from areal_sdk.config import ConfigError, load_config
    from areal_sdk.models import MaxModelLenError, ModelNotFoundError
    from areal_sdk.tasks import TaskError

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return fail(str(exc))
    if cfg.agent.entry is None or cfg.data.path is None:
        return fail("rollout needs agent.entry and data.path in the config")
    progress = Progress(
        TextColumn("[bold]episodes"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    bar = progress.add_task("rollout", total=None)
    try:
        with progress:
            summary, result = asyncio.run(
                _rollout(cfg, Path(args.config).resolve().parent, args.run_id, progress, bar)
            )
    except (TaskError, ModelNotFoundError, MaxModelLenError) as exc:
        return fail(str(exc), code=1)
    tokens = sum(e.num_tokens for e in summary.episodes)
    console.print(
        f"{result.episodes} episodes ({result.failed} failed) in {summary.seconds:.1f} s, "
        f"{tokens / max(summary.seconds, 1e-9):.0f} tokens/s",
        highlight=False,
    )
    console.print(f"reward {result}", highlight=False)
    for episode in summary.failed[:5]:
        # Agents' errors are text: `areal-sdk[camel]` in one is not rich markup.
        console.print(
            f"  failed {episode.id}: {episode.error}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        f"stored in {cfg.run.dir} (run id {args.run_id!r})", markup=False, highlight=False
    )
    return 0
