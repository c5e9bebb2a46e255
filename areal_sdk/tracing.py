"""``@areal.trace``: episodes as a context variable around the user's agent function.

Outside a rollout the decorator does nothing: the agent runs, returns and raises as written.
Inside one (a ``RolloutScope`` is active, set by the rollout controller), each call opens an
episode, routes the framework's model calls to the gateway with the episode's key, takes a
float return value as the reward, and records an exception as a failed episode instead of
raising it into the controller.

Context variables follow asyncio tasks automatically. Threads do not inherit them: wrap the
function with ``areal.bind`` (``executor.submit(areal.bind(fn), x)``) or use
``asyncio.to_thread``, which copies the context for you. Child processes started through
``subprocess`` inside an episode get its routing variables from the adapters; for any other
way of starting one, pass ``current_episode().env()`` (docs/capture.md).
"""

from __future__ import annotations

import abc
import contextvars
import functools
import inspect
import math
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, overload

from areal_sdk.trajectory import Episode, EpisodeStatus, new_id

P = ParamSpec("P")
R = TypeVar("R")

# Why an episode whose agent returned fails when the gateway recorded no model call.
NO_MODEL_CALL = (
    "no model call captured: the agent returned, but the gateway recorded no completion for "
    "this episode. Its client probably points elsewhere (a base_url given in code, a child "
    "process not started through subprocess, an SDK with no adapter), or its calls failed "
    "and the agent went on; see docs/capture.md"
)


def routing_env(gateway: str, api_key: str) -> dict[str, str]:
    """Environment variables that send SDK clients started with them to ``gateway`` (its
    root URL) under ``api_key``: every name the supported SDKs and frameworks read."""
    root = gateway.rstrip("/")
    return {
        "OPENAI_BASE_URL": f"{root}/v1",
        "OPENAI_API_BASE": f"{root}/v1",  # LangChain
        "OPENAI_API_BASE_URL": f"{root}/v1",  # CAMEL
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": root,
        "ANTHROPIC_API_URL": root,  # LangChain
        "ANTHROPIC_API_KEY": api_key,
        "AREAL_EPISODE_KEY": api_key,
        "AREAL_GATEWAY_URL": root,
    }


def reward_error(value: object, source: str) -> str | None:
    """Why ``value`` cannot be a reward (not a finite real number), or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{source} is not a number: {type(value).__name__} {value!r:.80}"
    if not math.isfinite(value):
        return f"{source} is not finite: {value!r}"
    return None


@dataclass
class EpisodeContext:
    """The live episode an agent call runs in."""

    episode: Episode
    name: str
    # The gateway this episode's calls go to, and the API key that ties them to it.
    base_url: str | None = None
    api_key: str | None = None
    explicit_reward: float | None = None
    turn_rewards: dict[str, float] = field(default_factory=dict)
    # Set by areal.reward() given something that is no reward: the episode fails with it.
    reward_error: str | None = None

    @property
    def id(self) -> str:
        return self.episode.id

    def env(self) -> dict[str, str]:
        """Environment variables that route a subprocess's SDK clients into this episode.

        Children started with ``subprocess`` inside the episode get them already; pass
        them yourself where the child's environment is built another way:

        >>> env = {**os.environ, **areal.current_episode().env()}  # doctest: +SKIP
        """
        if self.base_url is None or self.api_key is None:
            return {}
        return routing_env(self.base_url, self.api_key)


class RolloutScope(abc.ABC):
    """What the rollout controller provides while it runs agents.

    ``open_episode`` is called when a traced function starts and ``close_episode`` when it
    returns or raises; the scope decides where episodes go (gateway session, store).
    """

    @abc.abstractmethod
    def open_episode(self, task: Any, name: str) -> EpisodeContext: ...

    @abc.abstractmethod
    def close_episode(self, ctx: EpisodeContext) -> None: ...


_current_episode: contextvars.ContextVar[EpisodeContext | None] = contextvars.ContextVar(
    "areal_sdk_current_episode", default=None
)
_rollout_scope: contextvars.ContextVar[RolloutScope | None] = contextvars.ContextVar(
    "areal_sdk_rollout_scope", default=None
)


def current_episode() -> EpisodeContext | None:
    """The episode the caller runs in, or ``None`` outside a rollout."""
    return _current_episode.get()


def current_rollout() -> RolloutScope | None:
    return _rollout_scope.get()


@contextmanager
def rollout_scope(scope: RolloutScope) -> Iterator[RolloutScope]:
    """Make traced calls inside this block open episodes in ``scope``."""
    token = _rollout_scope.set(scope)
    try:
        yield scope
    finally:
        _rollout_scope.reset(token)


def reward(value: float, turn: str | None = None) -> None:
    """Set the current episode's reward (or one turn's reward, by turn id).

    Outside an episode this does nothing, so an agent calls it unconditionally. A value
    that is not a finite number (NaN, infinity, a string) fails the episode with the
    reason, whatever the agent does next: it is never trained as some number.
    """
    ctx = _current_episode.get()
    if ctx is None:
        return
    error = reward_error(value, "the reward given to areal.reward()")
    if error is not None:
        ctx.reward_error = ctx.reward_error or error
        return
    if turn is None:
        ctx.explicit_reward = float(value)
    else:
        ctx.turn_rewards[turn] = float(value)


def bind(fn: Callable[P, R]) -> Callable[P, R]:
    """Return ``fn`` bound to the caller's context, so a thread runs it inside the episode.

    >>> from concurrent.futures import ThreadPoolExecutor
    >>> with ThreadPoolExecutor() as pool:
    ...     pool.submit(bind(current_episode)).result() is None
    True
    """
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return ctx.run(fn, *args, **kwargs)

    return run


def _task_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    if "task" in kwargs:
        return kwargs["task"]
    return next(iter(kwargs.values()), None)


def _finish(ctx: EpisodeContext, result: Any, error: BaseException | None) -> None:
    ep = ctx.episode
    ep.ended = time.time()
    if error is not None:
        ep.status = EpisodeStatus.FAILED
        ep.error = "".join(traceback.format_exception_only(type(error), error)).strip()
        ep.metadata.setdefault("traceback", "".join(traceback.format_exception(error))[-4000:])
    elif ctx.reward_error is not None:
        ep.status, ep.error = EpisodeStatus.FAILED, ctx.reward_error
    elif isinstance(result, int | float) and not isinstance(result, bool):
        invalid = reward_error(result, "the reward the agent returned")
        if invalid is not None:
            ep.status, ep.error = EpisodeStatus.FAILED, invalid
        else:
            ep.reward = float(result)
    if ctx.explicit_reward is not None:
        ep.reward = ctx.explicit_reward
    for turn in ep.turns:
        if turn.id in ctx.turn_rewards:
            turn.reward = ctx.turn_rewards[turn.id]


def _enter(scope: RolloutScope, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]):
    ctx = scope.open_episode(_task_of(args, kwargs), name)
    return ctx, _current_episode.set(ctx)


@overload
def trace(fn: Callable[P, R], /) -> Callable[P, R]: ...
@overload
def trace(*, name: str | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def trace(fn: Callable[..., Any] | None = None, /, *, name: str | None = None) -> Any:
    """Mark an agent's entry function: ``agent(task) -> float | None``.

    >>> @trace
    ... def agent(task):
    ...     return 1.0
    >>> agent("2+2")  # no rollout active: runs as written
    1.0
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        label = name or func.__qualname__
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                scope = _rollout_scope.get()
                if scope is None or _current_episode.get() is not None:
                    return await func(*args, **kwargs)
                ctx, token = _enter(scope, label, args, kwargs)
                result, error = None, None
                try:
                    result = await func(*args, **kwargs)
                except Exception as exc:
                    error = exc
                finally:
                    _current_episode.reset(token)
                _finish(ctx, result, error)
                scope.close_episode(ctx)
                return result

            async_wrapper.__areal_trace__ = label  # type: ignore[attr-defined]
            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            scope = _rollout_scope.get()
            if scope is None or _current_episode.get() is not None:
                return func(*args, **kwargs)
            ctx, token = _enter(scope, label, args, kwargs)
            result, error = None, None
            try:
                result = func(*args, **kwargs)
            except Exception as exc:
                error = exc
            finally:
                _current_episode.reset(token)
            _finish(ctx, result, error)
            scope.close_episode(ctx)
            return result

        wrapper.__areal_trace__ = label  # type: ignore[attr-defined]
        return wrapper

    if fn is not None:
        return decorate(fn)
    return decorate


class LocalRollout(RolloutScope):
    """A scope that keeps finished episodes in memory (no gateway): for collecting rewards
    from agents that make no model calls, and for tests of the tracing contract."""

    def __init__(self, group_id: str | None = None) -> None:
        self.group_id = group_id
        self.episodes: list[Episode] = []

    def open_episode(self, task: Any, name: str) -> EpisodeContext:
        task_id = str(task.get("id", new_id("task"))) if isinstance(task, dict) else new_id("task")
        episode = Episode(task_id=task_id, group_id=self.group_id, metadata={"agent": name})
        return EpisodeContext(episode=episode, name=name)

    def close_episode(self, ctx: EpisodeContext) -> None:
        self.episodes.append(ctx.episode)
