"""The rollout controller: runs the user's traced agent over tasks and stores the episodes.

Each agent call gets a gateway session opened *before* the agent starts (so no HTTP happens
inside the user's code path), runs with a timeout, and is closed afterwards: the gateway
hands the episode with its turns to the store, which commits it before the call returns.
A failed or timed-out call becomes a failed episode; it never stops the run. Where the agent
runs is an ``AgentRunner``: this process by default, or worker processes
(``areal_sdk.services.agent_workers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import statistics
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from areal_sdk.tracing import (
    NO_MODEL_CALL,
    EpisodeContext,
    RolloutScope,
    reward_error,
    rollout_scope,
)
from areal_sdk.trajectory import Episode, EpisodeStatus

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.plugin_host import PluginHost

log = logging.getLogger(__name__)

# The error of an episode stopped because its group could no longer be trained (it would
# have been dropped as stale: rollout.max_staleness); such an episode is not retried.
STOPPED_STALE = "stopped: its group can no longer be trained within rollout.max_staleness"


class SessionClient(Protocol):
    """Opens and closes per-episode sessions; the gateway implements it over HTTP."""

    base_url: str | None

    async def open(self, episode: Episode) -> str:
        """Register the episode; return the API key that ties calls to it."""
        ...

    async def end(self, ctx: EpisodeContext) -> Episode:
        """Finalize (reward, status, error) and store the episode; return it with its turns."""
        ...


class StoreSessions:
    """Sessions without a gateway: episodes (with no turns) go straight to a store."""

    base_url = None

    def __init__(self, store: Any) -> None:
        self.store = store

    async def open(self, episode: Episode) -> str:
        return f"local-{episode.id}"

    async def end(self, ctx: EpisodeContext) -> Episode:
        await asyncio.to_thread(self.store.append, ctx.episode)
        return ctx.episode


_prepared: contextvars.ContextVar[EpisodeContext | None] = contextvars.ContextVar(
    "areal_sdk_prepared_episode", default=None
)


class _ControllerScope(RolloutScope):
    """Hands a traced call the episode the controller opened for it."""

    def open_episode(self, task: Any, name: str) -> EpisodeContext:
        ctx = _prepared.get()
        if ctx is None:
            raise RuntimeError(
                "a traced agent was called inside a rollout without an episode; run traced "
                "functions from the rollout controller's task, or wrap threads with areal.bind"
            )
        ctx.name = name
        ctx.episode.metadata.setdefault("agent", name)
        return ctx

    def close_episode(self, ctx: EpisodeContext) -> None:
        """Nothing to do here: the controller ends the session after the call returns."""


class AgentRunner(Protocol):
    """Where the agent runs: in this process (``InProcessRunner``) or in a worker process
    (``areal_sdk.services.agent_workers.AgentWorkerPool``)."""

    async def call(
        self, task: Any, ctx: EpisodeContext, *, timeout_s: float
    ) -> tuple[Any, str | None]:
        """Run the agent on ``task`` inside the episode ``ctx``; return its return value and
        ``None``, or ``None`` and why it failed (an error, a timeout). Whatever the agent
        does to the episode (status, reward, metadata) is on ``ctx`` when this returns."""
        ...

    async def close(self) -> None: ...


async def in_abandonable_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread of its own, in the caller's context.

    A caller that stops waiting (a timeout) abandons the thread: it holds no slot that a
    later call needs, as a hung call on a pool's thread would, and it never keeps the
    interpreter from exiting, as a pool's threads do (they are joined at exit).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():  # the caller gave up on it
            return
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)

    def target() -> None:
        value, error = None, None
        try:
            value = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # handed to the caller, whatever it is
            error = exc
        # A closed loop raises RuntimeError: nobody waits for this call any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name="areal-agent", daemon=True).start()
    return await done


class InProcessRunner:
    """The agent in this process: async agents on the running loop, sync agents on threads
    that a timeout abandons (``in_abandonable_thread``)."""

    def __init__(self, agent: Callable[..., Any], agent_kwargs: dict[str, Any] | None = None):
        self.agent = agent
        self.agent_kwargs = agent_kwargs or {}
        self._scope = _ControllerScope()

    async def call(
        self, task: Any, ctx: EpisodeContext, *, timeout_s: float
    ) -> tuple[Any, str | None]:
        token = _prepared.set(ctx)
        try:
            with rollout_scope(self._scope):
                if asyncio.iscoroutinefunction(self.agent):
                    call = self.agent(task, **self.agent_kwargs)
                else:
                    call = in_abandonable_thread(self.agent, task, **self.agent_kwargs)
                result = await asyncio.wait_for(call, timeout=timeout_s)
        except TimeoutError:
            return None, f"TimeoutError: agent did not finish within {timeout_s:g} s"
        except Exception as exc:  # the traced wrapper records agent errors; this is ours
            return None, f"{type(exc).__name__}: {exc}"
        finally:
            _prepared.reset(token)
        return result, None

    async def close(self) -> None:
        """Nothing to release: an abandoned thread ends with its call or with the process."""


@dataclass
class RolloutSummary:
    """What a rollout pass did, as printed at its end."""

    episodes: list[Episode] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> list[Episode]:
        return [e for e in self.episodes if e.status == EpisodeStatus.OK]

    @property
    def failed(self) -> list[Episode]:
        return [e for e in self.episodes if e.status != EpisodeStatus.OK]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.ok if e.reward is not None]

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(self.rewards) if self.rewards else math.nan

    @property
    def reward_std(self) -> float:
        return statistics.pstdev(self.rewards) if len(self.rewards) > 1 else 0.0

    @property
    def reward_sem(self) -> float:
        """Standard error of the mean reward."""
        n = len(self.rewards)
        return statistics.stdev(self.rewards) / math.sqrt(n) if n > 1 else math.nan

    @property
    def tokens(self) -> int:
        return sum(e.num_tokens for e in self.episodes)

    @property
    def no_model_call(self) -> list[Episode]:
        """Episodes that failed because the gateway saw no model call of their agent."""
        return [e for e in self.episodes if e.error == NO_MODEL_CALL]

    def as_dict(self) -> dict[str, float]:
        return {
            "episodes": float(len(self.episodes)),
            "episodes_ok": float(len(self.ok)),
            "episodes_failed": float(len(self.failed)),
            "episodes_no_model_call": float(len(self.no_model_call)),
            "reward_mean": self.mean_reward,
            "reward_std": self.reward_std,
            "reward_sem": self.reward_sem,
            "tokens": float(self.tokens),
            "seconds": self.seconds,
        }


RewardFn = Callable[[str, dict[str, Any]], float]
EpisodeCallback = Callable[[Episode], Awaitable[None] | None]


class RolloutController:
    """Runs ``agent(task)`` over tasks: ``group_size`` samples each, ``concurrency`` at once.

    Admission control (bounded staleness) is the caller's: the training loop admits a whole
    group before calling ``run_group``, and passes the version it started under as metadata.
    ``runner`` runs the agent elsewhere (``AgentWorkerPool.runner()``); ``agent`` may then be
    None.
    """

    def __init__(
        self,
        agent: Callable[..., Any] | None,
        sessions: SessionClient,
        *,
        group_size: int = 1,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        retries: int = 0,
        reward_fn: RewardFn | None = None,
        agent_kwargs: dict[str, Any] | None = None,
        on_episode: EpisodeCallback | None = None,
        runner: AgentRunner | None = None,
    ) -> None:
        self.agent = agent
        self.sessions = sessions
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.retries = retries
        self.reward_fn = reward_fn
        self.agent_kwargs = agent_kwargs or {}
        self.on_episode = on_episode
        self._slots = asyncio.Semaphore(concurrency)
        if runner is None:
            if agent is None:
                raise TypeError("RolloutController needs an agent or a runner")
            runner = InProcessRunner(agent, self.agent_kwargs)
        self.runner: AgentRunner = runner
        self.no_model_call = 0  # episodes failed for want of a captured model call
        self.stopped_stale = 0  # episodes stopped: their group could no longer be trained
        self.running = 0  # episodes whose agent is running now (holding a concurrency slot)

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        agent: Callable[..., Any] | None,
        sessions: SessionClient,
        *,
        host: PluginHost,
        group_size: int | None = None,
        agent_kwargs: dict[str, Any] | None = None,
        runner: AgentRunner | None = None,
    ) -> RolloutController:
        """The controller the ``rollout`` section describes, with ``agent.reward`` looked up
        in ``host``; ``group_size`` and ``agent_kwargs`` default to the config's. ``runner``
        runs the agent elsewhere (worker processes), given ``agent_kwargs`` already."""
        reward = host.reward_function(cfg.agent.reward) if cfg.agent.reward else None
        return cls(
            agent,
            sessions,
            group_size=cfg.rollout.group_size if group_size is None else group_size,
            concurrency=cfg.rollout.concurrency,
            timeout_s=cfg.rollout.timeout_s,
            retries=cfg.rollout.retries,
            reward_fn=reward,
            agent_kwargs=dict(cfg.agent.kwargs) if agent_kwargs is None else agent_kwargs,
            runner=runner,
        )

    async def run(self, tasks: Sequence[dict[str, Any]], *, progress: Any = None) -> RolloutSummary:
        """Every task ``group_size`` times; returns when all episodes are stored."""
        start = time.perf_counter()
        summary = RolloutSummary()
        jobs = []
        for task in tasks:
            group_id = f"grp-{task['id']}-{uuid.uuid4().hex[:8]}"
            jobs += [self.run_one(task, group_id) for _ in range(self.group_size)]
        for done in asyncio.as_completed(jobs):
            episodes = await done
            summary.episodes.extend(episodes)
            if progress is not None:
                progress(episodes[-1])
        summary.seconds = time.perf_counter() - start
        return summary

    async def run_group(
        self,
        task: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        group_id: str | None = None,
        samples: Sequence[int] | None = None,
        stop: asyncio.Event | None = None,
    ) -> list[Episode]:
        """One GRPO group: ``group_size`` final episodes of the same task, each with its
        sample index in ``metadata["sample"]``. ``group_id`` and ``samples`` run only some
        samples of an existing group, to complete one that a crash cut short. Once ``stop``
        is set (the group can no longer be trained), its unfinished episodes are stopped and
        fail with ``STOPPED_STALE``."""
        group_id = group_id or f"grp-{task['id']}-{uuid.uuid4().hex[:8]}"
        indices = range(self.group_size) if samples is None else samples
        results = await asyncio.gather(
            *(
                self.run_one(task, group_id, metadata={**(metadata or {}), "sample": i}, stop=stop)
                for i in indices
            )
        )
        return [attempts[-1] for attempts in results]

    async def run_one(
        self,
        task: dict[str, Any],
        group_id: str,
        *,
        metadata: dict[str, Any] | None = None,
        stop: asyncio.Event | None = None,
    ) -> list[Episode]:
        """One sample of a task, retried on failure; returns every attempt's episode."""
        attempts: list[Episode] = []
        for attempt in range(self.retries + 1):
            episode = await self._attempt(task, group_id, attempt, metadata or {}, stop)
            attempts.append(episode)
            if episode.status == EpisodeStatus.OK or episode.error == STOPPED_STALE:
                break
        return attempts

    async def _attempt(
        self,
        task: dict[str, Any],
        group_id: str,
        attempt: int,
        extra: dict[str, Any],
        stop: asyncio.Event | None = None,
    ) -> Episode:
        async with self._slots:
            metadata: dict[str, Any] = {**extra, "attempt": attempt}
            episode = Episode(task_id=str(task["id"]), group_id=group_id, metadata=metadata)
            api_key = await self.sessions.open(episode)
            ctx = EpisodeContext(
                episode=episode, name="agent", base_url=self.sessions.base_url, api_key=api_key
            )
            self.running += 1
            try:
                result, error = await self._call_until(stop, task, ctx)
            finally:
                self.running -= 1
            self._finalize(ctx, task, result, error)
            try:
                stored = await self.sessions.end(ctx)
            except Exception as exc:  # fail this episode alone: its group must still finish
                log.warning("episode %s could not be ended: %s", episode.id, exc)
                episode.status = EpisodeStatus.FAILED
                episode.error = f"could not end the episode ({type(exc).__name__}: {exc})"[:500]
                stored = episode
        if stored.error == NO_MODEL_CALL:
            self._count_no_model_call(stored)
        if self.on_episode is not None:
            maybe = self.on_episode(stored)
            if asyncio.iscoroutine(maybe):
                await maybe
        return stored

    async def _call_until(
        self, stop: asyncio.Event | None, task: dict[str, Any], ctx: EpisodeContext
    ) -> tuple[Any, str | None]:
        """``runner.call``, cancelled once ``stop`` is set: the runner stops the agent (a
        worker is told to), and the gateway aborts the generation whose client left."""
        if stop is None:
            return await self.runner.call(task, ctx, timeout_s=self.timeout_s)
        if stop.is_set():
            self.stopped_stale += 1
            return None, STOPPED_STALE
        call = asyncio.ensure_future(self.runner.call(task, ctx, timeout_s=self.timeout_s))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({call, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not call.done():
                call.cancel()
                # Its cleanup (a worker told to cancel) finishes before the episode ends.
                await asyncio.gather(call, return_exceptions=True)
        if call.cancelled():
            self.stopped_stale += 1
            return None, STOPPED_STALE
        return call.result()

    def _count_no_model_call(self, episode: Episode) -> None:
        self.no_model_call += 1
        if self.no_model_call == 1:  # once per controller: the reason is the same every time
            log.warning("episode %s failed: %s", episode.id, NO_MODEL_CALL)

    def _finalize(
        self, ctx: EpisodeContext, task: dict[str, Any], result: Any, error: str | None
    ) -> None:
        ep = ctx.episode
        ep.ended = ep.ended or time.time()
        if error is not None:
            ep.status, ep.error = EpisodeStatus.FAILED, error
            return
        if ep.status != EpisodeStatus.OK:
            return
        if ep.reward is not None or result is None or isinstance(result, int | float):
            if ep.reward is None:
                ep.metadata.setdefault("note", "agent returned no reward")
            return
        if isinstance(result, str) and self.reward_fn is not None:
            try:
                value = self.reward_fn(result, task)
            except Exception as exc:  # a bad score fails its episode, not the run
                value, invalid = None, f"the reward function raised {type(exc).__name__}: {exc}"
            else:
                invalid = reward_error(value, "the reward function's score")
            if invalid is None:
                ep.reward = float(value)
            else:
                ep.status, ep.error = EpisodeStatus.FAILED, invalid
            return
        ep.status, ep.error = (
            EpisodeStatus.FAILED,
            f"the agent returned a {type(result).__name__}, not a reward: return a float, "
            "call areal.reward(value), or set agent.reward to score the text it returns",
        )
