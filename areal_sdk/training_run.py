"""One ``areal-sdk train`` run: engine, gateway, rollouts and trainer, started and stopped together.

Everything runs on one event loop (the gateway on its own thread): held-out evaluation of the
initial policy, the asynchronous training loop, evaluation of the trained policy. The run
directory holds the trajectory store, metrics (JSONL, TensorBoard), the reward curve,
checkpoints and ``eval.json``.

Resuming (``resume=True``) loads the newest checkpoint, forgets consumption by steps whose
update was lost with the crash, and trains the accepted but untrained episodes first
(completing the groups the crash cut short), so no accepted episode is lost and none is
trained twice. Versions of weights lost with the process are never used again, and what they
sampled is not trained.

``interrupt()`` (the CLI calls it on SIGINT and SIGTERM) stops a run early without losing a
finished step: the step in flight finishes or is dropped, and the last finished step is
checkpointed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from areal_sdk.backends.train.defaults import compile_by_default
from areal_sdk.backends.weight_sync.base import PeerLostError
from areal_sdk.checkpoints import Checkpoint, Checkpoints
from areal_sdk.compute_threads import in_fresh_thread
from areal_sdk.config import Config
from areal_sdk.evaluation import EvalResult, evaluate, held_out_metrics
from areal_sdk.inference import InferenceBackend, PauseMode
from areal_sdk.launcher import LocalStack, open_agent
from areal_sdk.metrics import (
    EVAL_FILENAME,
    MetricLogger,
    check_sink_options,
    open_sink,
    plot_reward_curve,
    trajectory_rows,
)
from areal_sdk.plugin_host import PluginHost, get_host
from areal_sdk.rollout import RolloutController
from areal_sdk.services.control import ControlServer
from areal_sdk.services.health import ServiceFailed, ServiceState
from areal_sdk.services.placement import for_placement, resolve_placement
from areal_sdk.services.stack import ProcessStack, TrainerWatch
from areal_sdk.store import STORE_FILENAME, TrajectoryStore
from areal_sdk.supervisor import SupervisedEngine
from areal_sdk.tasks import load_tasks
from areal_sdk.train_backend import TrainBackend
from areal_sdk.train_process import TrainProcessError, build_train_backend
from areal_sdk.trainer import (
    AsyncTrainer,
    Group,
    Leftover,
    StepReport,
    TrainingError,
    start_step_of,
    unless_stopped,
)
from areal_sdk.trajectory import Episode, EpisodeStatus

log = logging.getLogger(__name__)

TRAIN_RUN = "train"


class RunError(RuntimeError):
    """The run cannot start as configured; the message says what to change."""


@dataclass
class RunResult:
    steps: int
    version: int
    before: EvalResult | None = None
    after: EvalResult | None = None
    reports: list[StepReport] = field(default_factory=list)
    run_dir: Path = Path()
    resumed_from: int | None = None
    refed_episodes: int = 0
    interrupted: str | None = None  # why the run stopped early (the signal's name), if it did
    checkpoint: Checkpoint | None = None  # the newest checkpoint when the run ended


class WeightPusher:
    """Pause the engine, push the trainer's weights as ``version``, resume; bounded in time.
    An engine that swaps a push in at once (``WeightSync.swaps_atomically``) is not paused.
    ``after`` runs once the engine serves the new version (the gateway process learns it)."""

    def __init__(
        self,
        cfg: Config,
        engine: InferenceBackend,
        backend: TrainBackend,
        host: PluginHost,
        *,
        after: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.engine = engine
        self.after = after
        self.backend = backend
        self.timeout_s = cfg.weights.timeout_s
        self.bucket_bytes = cfg.weights.bucket_mb << 20
        self.pause_mode = PauseMode(cfg.weights.pause_mode)
        self.sync = host.weight_sync_method(cfg.weights.method)(cfg, engine=engine)

    async def __call__(self, version: int) -> dict[str, float]:
        """Push ``version``; returns the seconds the engine took to pause, the buckets to
        arrive and the engine to resume (``time/push_*_s``), which tell a slow push's part."""
        started = time.perf_counter()
        # An engine that swaps the whole push in at once between two steps needs no pause;
        # its in-flight requests then recompute their keys as a retract would (or keep them,
        # as in place, without inference.recompute_kv_on_update). An abort still pauses.
        pause = not (self.sync.swaps_atomically and self.pause_mode != PauseMode.ABORT)
        if pause:
            await self.engine.pause(self.pause_mode)
        paused = time.perf_counter()
        try:
            try:
                await self._push(version)
            except PeerLostError as exc:
                # Servers died mid-push; those left (and restarted ones, which the fleet
                # brings up to date) take a fresh push. A second loss ends the run.
                log.warning("%s; pushing version %d again", exc, version)
                await self._push(version)
        except TimeoutError:
            raise TrainingError(
                f"pushing weight version {version} ({self.sync.method}) did not finish within "
                f"weights.timeout_s={self.timeout_s:g} s"
            ) from None
        finally:
            sent = time.perf_counter()
            if pause:
                await self.engine.resume()
        resumed = time.perf_counter()
        if self.engine.version != version:
            raise TrainingError(
                f"the engine serves version {self.engine.version} after pushing {version}"
            )
        if self.after is not None:
            await self.after(version)
        return {
            "time/push_pause_s": paused - started,
            "time/push_send_s": sent - paused,
            "time/push_resume_s": resumed - sent,
        }

    async def _push(self, version: int) -> None:
        if self.sync.takes_adapter:  # an engine serving LoRA adapters (train.lora)
            push = self.sync.push_adapter(self.backend.save_adapter, version)
        else:
            push = self.sync.push(self.backend.state_for_sync(self.bucket_bytes), version)
        await asyncio.wait_for(push, self.timeout_s)


def _final_samples(episodes: list[Episode], retries: int) -> dict[int, Episode]:
    """Sample index -> its final episode, of one group's ``episodes`` in order of storage.

    A failed attempt with retries left was followed by another or cut short by the crash:
    either way it is not final. Episodes stored before samples were numbered count as one
    sample each, in order (best effort)."""
    final: dict[int, Episode] = {}
    unnumbered: list[Episode] = []
    for e in episodes:
        if e.status != EpisodeStatus.OK and int(e.metadata.get("attempt", 0)) < retries:
            continue
        if "sample" in e.metadata:
            final[int(e.metadata["sample"])] = e  # a later attempt replaces an earlier one
        else:
            unnumbered.append(e)
    free = (i for i in itertools.count() if i not in final)
    for e in unnumbered:
        final[next(free)] = e
    return final


def _leftover_groups(
    store: TrajectoryStore,
    *,
    checkpoint_step: int,
    checkpoint_version: int,
    max_staleness: int,
    group_size: int,
    retries: int,
) -> tuple[list[Leftover], int]:
    """Groups of the training run that no step consumed and that may still train, each with
    the sample indices it lacks (episodes are stored one by one, so a crash can leave a group
    partial); and how many untrained episodes were sampled by weights the checkpoint does
    not descend from.

    Weights newer than the checkpoint died with the process: training on their samples would
    claim a policy that no longer exists. A group is of the checkpoint's lineage if it started
    under the version its step had there (``checkpoint_version - checkpoint_step`` apart) and
    no token is newer than the checkpoint; it is fresh enough if it started within
    ``max_staleness`` steps of the checkpoint."""
    offset = checkpoint_version - checkpoint_step
    by_group: dict[str, list[Episode]] = defaultdict(list)
    for episode in store.iter(run_id=TRAIN_RUN, consumed=False):
        by_group[episode.group_id or episode.id].append(episode)
    leftovers = []
    lost_weights = 0
    for gid, episodes in by_group.items():
        if store.count(group_id=gid, consumed=True):
            continue  # trained; these are failed attempts that its final ones replaced
        steps = [start_step_of(e) for e in episodes]
        started = [int(e.metadata.get("start_version", 0)) for e in episodes]
        sampled = [v for e in episodes if (v := e.max_version) is not None]
        lineage = all(v - k == offset for v, k in zip(started, steps, strict=True))
        if not lineage or max(started + sampled) > checkpoint_version:
            lost_weights += len(episodes)
            continue
        if min(steps) < checkpoint_step - max_staleness:
            continue
        final = _final_samples(episodes, retries)
        missing = [i for i in range(group_size) if i not in final]
        group = Group(gid, [final[i] for i in sorted(final)])
        leftovers.append(Leftover(group, episodes[0].task_id, missing))
    return leftovers, lost_weights


def _keep_latest_weights(stack: LocalStack | ProcessStack, backend: TrainBackend) -> None:
    """An engine rebuilt after it died gets the trainer's current weights."""
    if isinstance(stack, ProcessStack):
        stack.fleet.latest_weights = _weights_of(backend)
    elif isinstance(stack.engine, SupervisedEngine):
        stack.engine.latest_weights = _weights_of(backend)


async def _abandon(starting: asyncio.Future[ProcessStack] | None) -> None:
    """Stop services that were starting beside a trainer that failed to load: cancelled
    while starting (``ProcessStack.start`` stops what it began), stopped once up."""
    if starting is None:
        return
    starting.cancel()
    try:
        stack = await starting
    except BaseException:  # cancelled, or failed to start: nothing runs
        return
    await stack.stop()


def _weights_of(backend: TrainBackend) -> Callable[[], Any]:
    """The trainer's current weights and version, for an engine rebuilt after it died."""

    async def latest() -> tuple[dict[str, Any], int] | None:
        if backend.version == 0:
            return None  # the factory loads the initial weights itself
        tensors = {
            name: t.detach().clone()
            for bucket in backend.state_for_sync(256 << 20)
            for name, t in bucket
        }
        return tensors, backend.version

    return latest


def _sink_factories(cfg: Config, host: PluginHost) -> dict[str, Callable[..., Any]]:
    """The sinks ``run.metric_sinks`` names, their options checked: a missing sink or a
    wrong option fails the run before anything loads."""
    factories = {name: host.metric_sink(name) for name in cfg.run.metric_sinks}
    for name, factory in factories.items():
        try:
            check_sink_options(name, factory, cfg.run.metric_sink_options.get(name, {}))
        except ValueError as exc:
            raise RunError(str(exc)) from None
    return factories


def _sinks(cfg: Config, run_dir: Path, factories: dict[str, Callable[..., Any]]) -> MetricLogger:
    options = cfg.run.metric_sink_options
    return MetricLogger(
        [open_sink(name, f, run_dir, options.get(name, {})) for name, f in factories.items()]
    )


def _trajectory_logger(
    cfg: Config, metrics: MetricLogger, stack: LocalStack
) -> Callable[[int, list[Episode]], None] | None:
    """Logs a sample of each step's episodes, decoded, to the sinks that keep tables."""
    if not metrics.keeps_trajectories or cfg.run.trajectory_samples == 0:
        return None
    tokenizer = stack.engine.tokenizer if stack.engine is not None else None

    def decode(ids: list[int]) -> str:
        if tokenizer is None:
            return " ".join(map(str, ids))
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def log_sample(step: int, episodes: list[Episode]) -> None:
        sample = episodes[: cfg.run.trajectory_samples]
        metrics.log_trajectories(step, trajectory_rows(step, sample, decode))

    return log_sample


class TrainingRun:
    """Builds every part of a run from its config and runs it (``await run()``)."""

    def __init__(
        self,
        cfg: Config,
        *,
        config_dir: Path,
        resume: bool = False,
        host: PluginHost | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        if cfg.agent.entry is None:
            raise RunError("agent.entry is not set (module:function of your @areal.trace agent)")
        if cfg.data.path is None:
            raise RunError("data.path is not set (a JSONL file of training tasks)")
        self.placement = resolve_placement(cfg)
        cfg = for_placement(cfg, self.placement)
        self.cfg = cfg
        self.config_dir = config_dir
        self.resume = resume
        self.host = host or get_host()
        self.on_step = on_step
        self.on_event = on_event or (lambda message: log.info(message))
        self.run_dir = Path(cfg.run.dir)
        self.checkpoints = Checkpoints(
            self.run_dir,
            keep=cfg.run.keep_checkpoints,
            keep_optimizer_state=cfg.run.keep_optimizer_state,
        )
        self.store_path = self.run_dir / STORE_FILENAME
        self.stack: LocalStack | ProcessStack | None = None  # set while running
        self.failure: BaseException | None = None  # a service that failed for good
        self.interrupted: str | None = None
        self._stop: asyncio.Event | None = None  # set while running
        self._task: asyncio.Task[Any] | None = None
        self._trainer_watch: TrainerWatch | None = None
        if not resume and (self.store_path.exists() or self.checkpoints.latest() is not None):
            raise RunError(
                f"{self.run_dir} already holds a run: pass --resume to continue it, or set "
                "run.dir to a new directory"
            )
        if resume and not self.store_path.exists() and self.checkpoints.latest() is None:
            raise RunError(
                f"--resume: {self.run_dir} has no run to resume (no checkpoint, no store)"
            )
        self.tasks = load_tasks(
            cfg.data.path,
            id_field=cfg.data.id_field,
            limit=cfg.data.limit,
            shuffle=cfg.data.shuffle,
            seed=cfg.run.seed,
        )
        self.eval_tasks = (
            load_tasks(cfg.data.eval_path, id_field=cfg.data.id_field, limit=cfg.data.eval_limit)
            if cfg.data.eval_path
            else []
        )
        # Before any model loads, so a missing extra or a broken agent fails in seconds.
        self.sink_factories = _sink_factories(cfg, self.host)
        self.search_path = [config_dir, Path.cwd()]
        self.address, self.agent = open_agent(cfg, self.host, search_path=self.search_path)

    def _controller(
        self,
        agent: Any,
        stack: LocalStack | ProcessStack,
        run_id: str,
        *,
        group_size: int,
        agent_kwargs: dict[str, Any],
    ) -> RolloutController:
        return RolloutController.from_config(
            self.cfg,
            agent,
            stack.sessions(run_id),
            host=self.host,
            group_size=group_size,
            agent_kwargs=agent_kwargs,
            runner=stack.runner(agent_kwargs),
        )

    def services(self) -> list[ServiceState]:
        """Every service of the running run, as last seen (empty before it starts)."""
        states = [] if self.stack is None else self.stack.states()
        if self._trainer_watch is not None:
            states.append(self._trainer_watch.state)
        return states

    def interrupt(self, reason: str = "interrupted") -> None:
        """Stop the running run early; call it on the run's event loop (a signal handler).

        The step in flight finishes (or, still waiting for its groups, is dropped), the last
        finished step is checkpointed and ``run()`` returns with ``interrupted=reason``. A
        second call cancels the run at once, losing what was trained since the last
        checkpoint."""
        if self._stop is None:
            return
        if self._stop.is_set():
            if self._task is not None:
                self._task.cancel()
            return
        self.interrupted = reason
        self._stop.set()
        self.on_event(
            f"{reason}: finishing the step in flight and writing a checkpoint "
            "(interrupt again to stop at once)"
        )

    def _saved_eval(self, key: str) -> EvalResult | None:
        path = self.run_dir / EVAL_FILENAME
        saved = json.loads(path.read_text()).get(key) if path.is_file() else None
        return EvalResult(**saved) if saved else None

    def _write_eval(self, key: str, result: EvalResult) -> None:
        """Record one evaluation in ``eval.json`` as soon as it finished (atomically)."""
        path = self.run_dir / EVAL_FILENAME
        recorded = json.loads(path.read_text()) if path.is_file() else {}
        recorded[key] = result.as_dict()
        staging = path.with_suffix(".json.partial")
        staging.write_text(json.dumps(recorded, indent=2))
        staging.replace(path)

    async def _evaluate(
        self,
        agent: Any,
        stack: LocalStack | ProcessStack,
        store: TrajectoryStore,
        key: str,
        version: int,
    ) -> EvalResult | None:
        """The held-out reward of the policy at ``version`` (``key`` "before" or "after"),
        reused from ``eval.json`` when it was measured there already; None if interrupted."""
        saved = self._saved_eval(key)
        if saved is not None and saved.version == version:
            self.on_event(f"held-out reward {key} training (from {EVAL_FILENAME}): {saved}")
            return saved
        label = "initial" if key == "before" else "trained"
        run_id = f"eval-{label}"
        # A killed evaluation's episodes (or an earlier policy's) stay apart from this one's.
        aside = "partial" if saved is None else f"v{saved.version}"
        store.relabel_run(run_id, f"{run_id}-{aside}")
        kwargs = {**self.cfg.agent.kwargs, **self.cfg.eval.agent_kwargs}
        controller = self._controller(
            agent, stack, run_id, group_size=self.cfg.eval.samples, agent_kwargs=kwargs
        )
        tasks, samples = len(self.eval_tasks), self.cfg.eval.samples
        self.on_event(
            f"evaluating the {label} policy: {tasks} held-out tasks x {samples} "
            f"sample{'s' if samples != 1 else ''} = {tasks * samples} episodes"
        )
        assert self._stop is not None
        result = await unless_stopped(
            evaluate(controller, self.eval_tasks, version=version), self._stop
        )
        if result is not None:
            self._write_eval(key, result)
            self.on_event(f"held-out reward {key} training: {result}")
        return result

    def _announcing_compile(
        self, on_step: Callable[[StepReport], None] | None
    ) -> Callable[[StepReport], None] | None:
        """``on_step``, saying first that the first step compiles the trainer's layers (tens
        of seconds of an otherwise silent wait) and after it what that step took."""
        if not compile_by_default(self.cfg.train.compile, torch.device(self.cfg.train.device)):
            return on_step
        self.on_event(
            "the first training step compiles the trainer's decoder layers "
            "(torch.compile, 15-60 s once per run; train.compile=false skips it)"
        )
        first = True

        def announce(report: StepReport) -> None:
            nonlocal first
            if first:
                first = False
                m = report.metrics
                train_s = m.get("time/step_s", 0.0) - m.get("time/wait_s", 0.0)
                train_s -= m.get("time/push_s", 0.0)
                self.on_event(f"first training step: {train_s:.0f} s, the compile included")
            if on_step is not None:
                on_step(report)

        return announce

    async def _start_services(self, store: TrajectoryStore) -> ProcessStack:
        """Every service in a process of its own, on this machine or as Ray actors."""
        if self.placement == "ray":
            from areal_sdk.services.ray_stack import RayStack

            kind: type[ProcessStack] = RayStack
        else:
            kind = ProcessStack
        stack = kind(
            self.cfg,
            store,
            host=self.host,
            address=self.address,
            run_dir=self.run_dir,
            search_path=self.search_path,
            on_event=self.on_event,
        )
        return await stack.start()

    async def _start_local_stack(self, store: TrajectoryStore) -> LocalStack:
        """The engine and the gateway in this process."""
        self.on_event("starting the engine and the gateway")
        local = LocalStack(
            self.cfg, store, host=self.host, on_restart=self.on_event, address=self.address
        )
        await asyncio.to_thread(local.start)
        return local

    async def _resume(
        self,
        backend: TrainBackend,
        store: TrajectoryStore,
        metrics: MetricLogger,
        result: RunResult,
    ) -> list[Leftover]:
        """Load the newest checkpoint (or start over when the run died before its first),
        release the steps it lost and return the accepted groups to train first."""
        rollout = self.cfg.rollout
        latest = self.checkpoints.latest()
        if latest is not None:
            await in_fresh_thread(backend.load, latest.path)
        start, version = backend.step, backend.version
        released = store.release_consumed_from(start)
        metrics.drop_after(start)  # those steps are trained again: logged once
        leftovers, lost_weights = _leftover_groups(
            store,
            checkpoint_step=start,
            checkpoint_version=version,
            max_staleness=rollout.max_staleness,
            group_size=rollout.group_size,
            retries=rollout.retries,
        )
        highest = store.highest_version()
        if highest is not None and highest > version:
            # Versions after the checkpoint's named weights that died with the process:
            # the checkpoint's weights and their successors get numbers never used before.
            backend.initial_version = highest + 1 - start
            self.on_event(
                f"weight versions {version + 1}-{highest} were lost with the process; "
                f"the checkpoint's weights continue as version {backend.version}"
            )
        result.resumed_from = start
        result.refed_episodes = sum(len(left.group.episodes) for left in leftovers)
        partial = sum(1 for left in leftovers if left.missing)
        self.on_event(
            f"resumed from step {start}: {released} episodes of lost steps released, "
            f"{result.refed_episodes} accepted episodes queued to train first "
            f"({partial} partial groups to complete); {lost_weights} sampled by weights "
            "the checkpoint does not descend from are left untrained"
        )
        return leftovers

    def _resume_hint(self) -> str:
        latest = self.checkpoints.latest()
        if latest is not None and latest.step > 0:
            return f"`areal-sdk train --resume` continues from its checkpoint of step {latest.step}"
        return "`areal-sdk train --resume` continues the run"

    def _supervise(
        self, stack: LocalStack | ProcessStack, backend: TrainBackend
    ) -> asyncio.Task[None]:
        """Watch every service; one that fails for good cancels the run, which then raises
        its ``ServiceFailed``."""
        self._trainer_watch = TrainerWatch(backend)

        async def watch() -> None:
            assert self._trainer_watch is not None
            async with asyncio.TaskGroup() as group:
                group.create_task(stack.supervise())
                group.create_task(self._trainer_watch.watch(resume_hint=self._resume_hint))

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled() or task.exception() is None:
                return
            error = task.exception()
            while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
                error = error.exceptions[0]
            self.failure = error
            if not isinstance(error, ServiceFailed):
                log.error("service supervision failed", exc_info=error)
            self.on_event(f"stopping the run: {error}")
            if self._task is not None:
                self._task.cancel()

        task = asyncio.create_task(watch())
        task.add_done_callback(done)
        return task

    async def run(self) -> RunResult:
        cfg = self.cfg
        self._stop = asyncio.Event()
        self._task = asyncio.current_task()
        stop = self._stop
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        store = TrajectoryStore(self.store_path, run_id=TRAIN_RUN)
        metrics = _sinks(cfg, self.run_dir, self.sink_factories)
        metrics.log_config(cfg.model_dump(mode="json"))
        result = RunResult(steps=0, version=0, run_dir=self.run_dir)
        self.on_event("loading the train backend")
        building = asyncio.ensure_future(
            in_fresh_thread(build_train_backend, cfg, self.host, self.on_event)
        )
        # Processes of their own start while the trainer loads: each takes seconds to tens of
        # seconds (an engine server loads and captures its graphs, a gateway imports), and
        # none needs the trainer before the first weight push. (Under Ray the trainer's ranks
        # and the services share one connection, which the trainer opens first.)
        starting = (
            asyncio.ensure_future(self._start_services(store))
            if self.placement == "processes"
            else None
        )
        try:
            backend: TrainBackend = await building
        except BaseException:
            await _abandon(starting)
            raise
        try:
            leftovers = await self._resume(backend, store, metrics, result) if self.resume else []
            if starting is not None:
                stack: LocalStack | ProcessStack = await starting
            elif self.placement == "ray":
                stack = await self._start_services(store)
            else:
                stack = await self._start_local_stack(store)
            self.stack = stack
        except BaseException:
            await _abandon(starting)
            backend.close()
            raise
        _keep_latest_weights(stack, backend)
        control = ControlServer(
            self.run_dir,
            placement=self.placement,
            states=self.services,
            add_engine=stack.add_engine if isinstance(stack, ProcessStack) else None,
            remove_engine=stack.remove_engine if isinstance(stack, ProcessStack) else None,
        )
        control.start(asyncio.get_running_loop())
        supervision = self._supervise(stack, backend)
        try:
            assert stack.engine is not None
            after = stack.after_weight_push if isinstance(stack, ProcessStack) else None
            pusher = WeightPusher(cfg, stack.engine, backend, self.host, after=after)
            if backend.version != stack.engine.version:
                await pusher(backend.version)  # a resumed run serves its checkpoint's weights
            agent = self.agent
            if self.eval_tasks and cfg.eval.before and not stop.is_set():
                # The initial policy: evaluated unless a resumed run measured it already.
                if backend.step == 0 or self._saved_eval("before") is not None:
                    initial = backend.version - backend.step
                    result.before = await self._evaluate(agent, stack, store, "before", initial)
                    if result.before is not None:
                        metrics.log_eval(0, held_out_metrics(result.before))
                else:
                    self.on_event("no held-out reward before training was recorded in this run")
            controller = self._controller(
                agent,
                stack,
                TRAIN_RUN,
                group_size=cfg.rollout.group_size,
                agent_kwargs=dict(cfg.agent.kwargs),
            )

            def checkpoint(_step: int) -> None:
                saved = self.checkpoints.save(backend)
                self.on_event(f"checkpoint {saved.path}")

            trainer = AsyncTrainer(
                cfg,
                backend=backend,
                controller=controller,
                push_weights=pusher,
                store=store,
                run_dir=self.run_dir,
                log=metrics.log,
                checkpoint=checkpoint,
                on_step=self._announcing_compile(self.on_step),
                on_episodes=_trajectory_logger(cfg, metrics, stack),
                stop=stop,
            )
            if not stop.is_set():
                started = time.perf_counter()
                result.reports = await trainer.train(self.tasks, leftovers=leftovers)
                self.on_event(
                    f"trained {len(result.reports)} steps in "
                    f"{time.perf_counter() - started:.0f} s; "
                    f"max staleness {trainer.max_seen_staleness}"
                )
            if self.eval_tasks and cfg.eval.after and not stop.is_set():
                result.after = await self._evaluate(agent, stack, store, "after", backend.version)
                if result.after is not None:
                    metrics.log_eval(backend.step, held_out_metrics(result.before, result.after))
        except asyncio.CancelledError:
            if self.failure is not None:
                raise self.failure from None  # a service failed for good: the run stops
            raise
        except TrainProcessError as exc:  # found by a call before the watch saw it
            raise ServiceFailed(
                "trainer", f"the trainer died: {exc}; {self._resume_hint()}"
            ) from None
        finally:
            supervision.cancel()
            await asyncio.gather(supervision, return_exceptions=True)
            services = self.services()  # stopping a service may take it off the list
            if isinstance(stack, ProcessStack):
                await stack.stop()
            else:
                await asyncio.to_thread(stack.stop)
            control.stop(services)
            metrics.close()
            backend.close()
        result.steps = backend.step
        result.version = backend.version
        result.interrupted = self.interrupted
        result.checkpoint = self.checkpoints.latest()
        plot_reward_curve(self.run_dir)
        store.close()
        return result
