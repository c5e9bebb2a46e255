"""The asynchronous training loop: rollouts keep running while the trainer trains.

One episode's way from the agent to the gradient::

    producer ── staleness admission ──► RolloutController ──► gateway ──► store (durable)
                                              │ finished group
                                              ▼
    trainer ◄── GroupBuffer (whole groups, freshness-checked, optional dynamic filter)
       │ samples ─► advantages ─► packed micro-batches ─► proximal logprobs ─► train_step
       ▼
    push weights (pause engine, sync, resume) ─► mark consumed ─► version + 1 ─► admit more

Everything the loop needs arrives as an argument, so the loop itself runs the same with the
embedded engine in process or SGLang servers elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from areal_sdk.algorithms.advantages import sample_advantages
from areal_sdk.algorithms.losses import make_loss_fn
from areal_sdk.config import Config
from areal_sdk.packing import pack_samples
from areal_sdk.rollout import RolloutController
from areal_sdk.samples import build_batch_samples
from areal_sdk.staleness import StalenessController
from areal_sdk.store import TrajectoryStore
from areal_sdk.train_backend import TrainBackend
from areal_sdk.trajectory import Episode, EpisodeStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Groups in a row whose every episode failed before the run stops: 64 failed episodes at
# the default group size, which a run that can train does not see.
FAILED_GROUPS_LIMIT = 8


class TrainingError(RuntimeError):
    """A step cannot complete (a weight push timed out, the engine died, ...)."""


@dataclass
class Group:
    """The episodes of one task sampled ``group_size`` times (failed ones included)."""

    group_id: str
    episodes: list[Episode]

    @property
    def ok(self) -> list[Episode]:
        return [e for e in self.episodes if e.status == EpisodeStatus.OK]

    @property
    def start_version(self) -> int:
        return min(int(e.metadata.get("start_version", 0)) for e in self.episodes)

    @property
    def start_step(self) -> int:
        """The trainer's step (updates taken) when the group started: staleness counts
        updates, and a resumed run's weight versions may skip numbers lost with a crash."""
        return min(start_step_of(e) for e in self.episodes)

    @property
    def rewards(self) -> list[float]:
        return [e.reward or 0.0 for e in self.ok]


def start_step_of(episode: Episode) -> int:
    """The trainer's step when ``episode``'s group started (episodes stored before steps
    were recorded ran where version and step were one)."""
    meta = episode.metadata
    return int(meta.get("start_step", meta.get("start_version", 0)))


@dataclass
class Leftover:
    """An accepted, untrained group of a resumed run. A crash while the group ran leaves it
    partial: its ``missing`` sample indices of task ``task_id`` run before it trains."""

    group: Group
    task_id: str
    missing: list[int] = field(default_factory=list)


class GroupBuffer:
    """Finished groups waiting to train: those started under the oldest policy version first,
    then in the order they finished.

    Groups finish out of order (a long reply outlives several steps). Taking the oldest
    version first trains a group while it is still within the staleness bound and lets a
    fresher one, which has slack, wait a step; first-finished-first would drop the old group
    as stale a step later.
    """

    def __init__(self) -> None:
        self._groups: asyncio.PriorityQueue[tuple[int, int, Group]] = asyncio.PriorityQueue()
        self._finished = itertools.count()

    def put(self, group: Group) -> None:
        self._groups.put_nowait((group.start_step, next(self._finished), group))

    async def get(self) -> Group:
        return (await self._groups.get())[2]

    def qsize(self) -> int:
        return self._groups.qsize()


@dataclass
class StepReport:
    """One finished step. ``step`` counts from 1: the number of updates the weights have had,
    as the CLI, the metrics, TensorBoard, the reward curve and the checkpoints name it."""

    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None once ``stop`` is set first (``work`` is then cancelled)."""
    job = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({job, stopped}, return_when=asyncio.FIRST_COMPLETED)
        return job.result() if job.done() else None
    finally:
        for pending in (job, stopped):
            pending.cancel()
        await asyncio.gather(job, stopped, return_exceptions=True)


def cycle_tasks(tasks: Sequence[dict[str, Any]], *, start: int = 0) -> Iterator[dict[str, Any]]:
    """Tasks forever, in order, starting at ``start`` (so a resumed run moves on)."""
    return itertools.islice(itertools.cycle(tasks), start, None)


class AsyncTrainer:
    """Runs the producer (rollouts) and the trainer concurrently for ``run.steps`` steps."""

    def __init__(
        self,
        cfg: Config,
        *,
        backend: TrainBackend,
        controller: RolloutController,
        push_weights: Callable[[int], Awaitable[Mapping[str, float] | None]],
        store: TrajectoryStore,
        run_dir: Path,
        log: Callable[[int, dict[str, float]], None],
        checkpoint: Callable[[int], None] | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        on_episodes: Callable[[int, list[Episode]], None] | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.controller = controller
        self.push_weights = push_weights
        self.store = store
        self.run_dir = run_dir
        self.log = log
        self.checkpoint = checkpoint
        self.on_step = on_step
        self.on_episodes = on_episodes  # each step's trained episodes (a sample is logged)
        self.stop = stop or asyncio.Event()
        self.group_size = cfg.rollout.group_size
        self.groups_per_step = cfg.rollout.batch_size // cfg.rollout.group_size
        # Admission counts updates (steps); the weights of step k carry version k + offset.
        self.staleness = StalenessController(
            batch_size=cfg.rollout.batch_size,
            max_staleness=cfg.rollout.max_staleness,
            version=backend.step,
            admitted=backend.step * cfg.rollout.batch_size,
        )
        self.version_offset = backend.version - backend.step
        self.buffer = GroupBuffer()
        # Set once the groups started at that step can no longer be trained: their
        # unfinished episodes stop, rather than generate for a group dropped as stale.
        self._stale_after: dict[int, asyncio.Event] = {}
        self.max_seen_staleness = 0
        self._failed_in_a_row = 0  # groups whose every episode failed, since one did not
        self.groups_started = 0
        self._rollout_tokens = 0
        self._rollout_started = time.perf_counter()

    # -- producer ------------------------------------------------------------------------------

    async def _produce(
        self,
        tasks: Iterator[dict[str, Any]],
        leftovers: Sequence[Leftover],
        by_id: Mapping[str, dict[str, Any]],
    ) -> None:
        """Queue ``leftovers`` (accepted groups of a resumed run) first, completing partial
        ones, then start a group whenever admission control has room for all of its
        episodes."""
        in_flight: set[asyncio.Task[None]] = set()

        def start(run: Coroutine[Any, Any, None]) -> None:
            job = asyncio.create_task(run)
            in_flight.add(job)
            job.add_done_callback(in_flight.discard)

        try:
            for left in leftovers:
                left_task = by_id.get(left.task_id)
                if left.missing and left_task is None:
                    logger.warning(
                        "leftover group %s is missing samples %s of task %r, which the data "
                        "no longer has: not trained",
                        left.group.group_id,
                        left.missing,
                        left.task_id,
                    )
                    continue
                # A completed group trains group_size episodes, so it holds as many slots.
                for _ in range(len(left.group.episodes) + len(left.missing)):
                    await self.staleness.acquire()
                if left.missing:  # its task is known: the groups without one were skipped
                    assert left_task is not None
                    start(self._run_group(left_task, self.staleness.version, left))
                else:
                    self.buffer.put(left.group)
            for task in tasks:
                for _ in range(self.group_size):
                    await self.staleness.acquire()
                start(self._run_group(task, self.staleness.version))
                self.groups_started += 1
        finally:
            for job in in_flight:
                job.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _run_group(
        self, task: dict[str, Any], start_step: int, leftover: Leftover | None = None
    ) -> None:
        """A new group, or the missing samples of ``leftover`` under its group id; either way
        the whole group goes to the buffer."""
        episodes = await self.controller.run_group(
            task,
            metadata={
                "start_version": start_step + self.version_offset,
                "start_step": start_step,
            },
            group_id=leftover.group.group_id if leftover else None,
            samples=leftover.missing if leftover else None,
            stop=self._stale_after.setdefault(start_step, asyncio.Event()),
        )
        self._rollout_tokens += sum(e.num_tokens for e in episodes)
        kept = leftover.group.episodes if leftover else []
        self.buffer.put(Group(episodes[0].group_id or "", [*kept, *episodes]))

    # -- trainer -------------------------------------------------------------------------------

    def _stop_stale_groups(self, step: int) -> None:
        """Stop the episodes of groups that step ``step`` and every later one would drop as
        stale: a long-tailed group otherwise keeps its slowest members generating for
        nothing, and its admission slots from fresh groups."""
        for start_step in [s for s in self._stale_after if not self.staleness.is_fresh(s, step)]:
            self._stale_after.pop(start_step).set()

    def _check_failing(self, group: Group) -> None:
        """Count groups whose every episode failed; past ``FAILED_GROUPS_LIMIT`` in a row the
        run stops with the last error instead of starting new groups forever (a prompt over
        the context, an agent that always raises)."""
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= FAILED_GROUPS_LIMIT:
            last = next((e.error for e in reversed(group.episodes) if e.error), "no error given")
            raise TrainingError(
                f"every episode of the last {self._failed_in_a_row} groups failed; the last "
                f"error: {last}"
            )

    async def _next_groups(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """Whole groups for one step: stale or (with dynamic filtering) flat groups are
        dropped, their admission slots given back so fresh ones start."""
        chosen: list[Group] = []
        dropped_stale = dropped_flat = dropped_failed = 0
        while len(chosen) < self.groups_per_step:
            group = await self.buffer.get()
            if not self.staleness.is_fresh(group.start_step, step):
                dropped_stale += 1
            elif not group.ok:
                dropped_failed += 1
                self._check_failing(group)
            elif self.cfg.algorithm.dynamic_filter and len(set(group.rewards)) <= 1:
                dropped_flat += 1
            else:
                chosen.append(group)
                self._failed_in_a_row = 0
                continue
            await self.staleness.give_back(len(group.episodes))
        return chosen, {
            "rollout/dropped_stale_groups": float(dropped_stale),
            "rollout/dropped_flat_groups": float(dropped_flat),
            "rollout/dropped_failed_groups": float(dropped_failed),
        }

    @property
    def _micro_batch_tokens(self) -> int:
        # As configured, else what the backend chose for its device.
        return self.cfg.train.micro_batch_tokens or self.backend.micro_batch_tokens

    @property
    def _share_prefixes(self) -> bool:
        train = self.cfg.train
        if train.share_prefixes is not None:
            return train.share_prefixes
        return train.attn_implementation == "varlen"

    def _train_on(self, groups: list[Group], step: int) -> dict[str, float]:
        """The blocking part of a step (runs in a worker thread)."""
        episodes = [e for g in groups for e in g.ok]
        samples, merge_stats = build_batch_samples(episodes)
        advantages = sample_advantages(samples, self.cfg.algorithm.advantage)
        # One equal share per trainer rank, rank-major: a group of ranks (RayTrainGroup)
        # sends each rank its share.
        shares = pack_samples(
            samples,
            advantages,
            self._micro_batch_tokens,
            num_ranks=self.backend.world_size,
            share_prefixes=self._share_prefixes,
        )
        micro_batches = [mb for share in shares for mb in share]
        # The proximal policy is the weights at the start of this update. The step makes one
        # optimizer update, so the update's own forward computes them; the loss takes its
        # detached logprobs unless a separate pass filled them in.
        if self.cfg.algorithm.decoupled and self.cfg.algorithm.separate_proximal_pass:
            for mb, prox in zip(
                micro_batches, self.backend.forward_logprobs(micro_batches), strict=True
            ):
                mb.proximal_logprobs = prox
        loss_fn = make_loss_fn(self.cfg.algorithm, current_version=self.backend.version)
        metrics = self.backend.train_step(micro_batches, loss_fn)
        metrics.update(merge_stats.as_metrics())
        metrics["train/micro_batches"] = float(len(micro_batches))
        metrics["train/samples"] = float(len(samples))
        return metrics

    async def _step(
        self, index: int, taken: tuple[list[Group], dict[str, float]], wait_s: float
    ) -> StepReport:
        """Train on the ``taken`` groups as update ``index`` (0-based), push, mark them
        consumed."""
        t0 = time.perf_counter() - wait_s
        groups, metrics_of_drops = taken
        # Where the admitted episodes are as the step starts: whether admission, the agents
        # or the buffer holds back the engine's batch.
        admission = {
            "rollout/running": float(self.controller.running),
            "rollout/buffered_groups": float(self.buffer.qsize()),
            "rollout/admission_room": float(self.staleness.capacity()),
        }
        staleness = [index - g.start_step for g in groups]
        self.max_seen_staleness = max(self.max_seen_staleness, *staleness)
        metrics = await asyncio.to_thread(self._train_on, groups, index)
        new_version = self.backend.version
        t_push = time.perf_counter()
        push_parts = await self.push_weights(new_version)
        push_s = time.perf_counter() - t_push
        ids = [e.id for g in groups for e in g.episodes]
        await asyncio.to_thread(self.store.mark_consumed, ids, index)
        await self.staleness.set_version(self.backend.step)
        rewards = [r for g in groups for r in g.rewards]
        elapsed = time.perf_counter() - self._rollout_started
        metrics.update(metrics_of_drops)
        metrics.update(admission)
        metrics.update(push_parts or {})
        metrics.update(
            {
                "rollout/reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
                "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                "rollout/episodes": float(sum(len(g.episodes) for g in groups)),
                "rollout/failed": float(sum(len(g.episodes) - len(g.ok) for g in groups)),
                "rollout/no_model_call": float(self.controller.no_model_call),  # run total
                # Run total: episodes stopped because their group could no longer train.
                "rollout/stopped_stale": float(self.controller.stopped_stale),
                "rollout/staleness_max": float(max(staleness)),
                "rollout/staleness_mean": statistics.fmean(staleness),
                "rollout/tokens_per_s": self._rollout_tokens / elapsed if elapsed > 0 else 0.0,
                # Generated tokens this update trained on (the groups taken, not those dropped).
                "rollout/trained_tokens": float(sum(e.num_tokens for g in groups for e in g.ok)),
                "time/wait_s": wait_s,
                "time/step_s": time.perf_counter() - t0,
                "time/push_s": push_s,
                "weights/version": float(new_version),
            }
        )
        report = StepReport(step=index + 1, version=new_version, metrics=metrics)
        self.log(report.step, metrics)
        if self.on_episodes is not None:
            self.on_episodes(report.step, [e for g in groups for e in g.ok])
        if self.on_step is not None:
            self.on_step(report)
        return report

    async def train(
        self, tasks: Sequence[dict[str, Any]], *, leftovers: Sequence[Leftover] = ()
    ) -> list[StepReport]:
        """Train from the backend's current step to ``run.steps``; ``leftovers`` (accepted,
        untrained groups of a resumed run, partial ones completed on their task in ``tasks``)
        are trained before new rollouts.

        Setting ``stop`` ends training early: a step still waiting for its groups is dropped
        (they stay unconsumed in the store, so a resumed run trains them), a step that has
        its groups finishes, and the last finished step is checkpointed."""
        first = self.backend.step
        by_id = {str(task["id"]): task for task in tasks}
        producer = asyncio.create_task(
            self._produce(cycle_tasks(tasks, start=first * self.groups_per_step), leftovers, by_id)
        )
        reports: list[StepReport] = []
        checkpointed = first
        try:
            for index in range(first, self.cfg.run.steps):
                if producer.done():
                    producer.result()  # re-raise a producer failure
                    raise TrainingError("the rollout producer stopped")
                if self.stop.is_set():
                    break
                self._stop_stale_groups(index)
                waited = time.perf_counter()
                taken = await unless_stopped(self._next_groups(index), self.stop)
                if taken is None:
                    break
                report = await self._step(index, taken, time.perf_counter() - waited)
                reports.append(report)
                every = self.cfg.run.checkpoint_every
                last = report.step == self.cfg.run.steps
                if self.checkpoint is not None and (last or (every and report.step % every == 0)):
                    await asyncio.to_thread(self.checkpoint, report.step)
                    checkpointed = report.step
            if self.checkpoint is not None and self.backend.step > checkpointed:
                # Stopped early: what was trained since the last checkpoint is kept.
                await asyncio.to_thread(self.checkpoint, self.backend.step)
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        return reports
