"""Per-episode sessions: an unguessable key ties API calls to one episode's turns.

``POST /rl/sessions`` creates a session and returns its key; a call made with that key as its
API key is recorded as a ``Turn`` of that episode and may continue only that episode's earlier
turns. Ending a session waits for its calls in flight, hands the finished ``Episode`` to the
sink (``sink.append(episode)``, which commits it) and only then acknowledges; from then on the
key is refused for calls. Ending an ended session again is harmless: it answers what the first
end did. A session with no call for ``idle_timeout_s`` is ended as failed (``reap_idle``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from areal_sdk.gateway.conversation import Message
from areal_sdk.gateway.metrics import GatewayMetrics
from areal_sdk.gateway.templating import HistoryEntry
from areal_sdk.store import DuplicateEpisodeError
from areal_sdk.tracing import NO_MODEL_CALL
from areal_sdk.trajectory import Episode, EpisodeStatus, Turn, new_id

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-areal-"
# previous_response_id keeps this many responses per session (oldest forgotten first)
MAX_STORED_RESPONSES = 256
# Ended sessions remembered (about 360 bytes each), so that ending one again is harmless
# and its episode id cannot be reused.
MAX_ENDED_REMEMBERED = 16384


class EpisodeSink(Protocol):
    """Where finished episodes go; ``append`` returns once the episode is durable."""

    def append(self, episode: Episode) -> Any: ...


def new_key() -> str:
    """256 random bits; the episode id is not derivable from it (nor it from the id)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass
class Session:
    episode: Episode
    key: str
    history: list[HistoryEntry] = field(default_factory=list)
    # /v1/completions: (prompt text + completion text, the ids behind it) per call
    text_history: list[tuple[str, list[int]]] = field(default_factory=list)
    responses: OrderedDict[str, list[Message]] = field(default_factory=OrderedDict)
    state: str = "open"  # open -> ending -> ended (back to open if the sink fails)
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # set unless an end is storing the episode right now
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    last_active: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.idle.set()
        self.settled.set()

    def remember_response(self, response_id: str, conversation: list[Message]) -> None:
        self.responses[response_id] = conversation
        while len(self.responses) > MAX_STORED_RESPONSES:
            self.responses.popitem(last=False)


@dataclass(frozen=True, slots=True)
class EndedSession:
    """What is kept of an ended session: enough to answer a second end as the first."""

    episode_id: str
    key: str
    status: EpisodeStatus
    reward: float | None
    turns: int


class SessionError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def check_reward(value: float | None, param: str = "reward") -> None:
    """A reward must be a finite number: NaN or infinity would train as garbage."""
    if value is not None and not math.isfinite(value):
        raise SessionError(400, f"'{param}' must be a finite number, got {value}", param=param)


class SessionManager:
    """Sessions by key and by episode id; one event loop, so no locks are needed.

    ``idle_timeout_s`` (None: never) is how long an open session may go without a call
    before ``reap_idle`` ends it as failed.
    """

    def __init__(
        self,
        sink: EpisodeSink | None,
        metrics: GatewayMetrics,
        host: Any = None,
        *,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.sink = sink
        self.metrics = metrics
        self.host = host
        self.idle_timeout_s = idle_timeout_s
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, Session] = {}
        self._ended: OrderedDict[str, EndedSession] = OrderedDict()
        self._ended_keys: dict[str, str] = {}
        metrics.sessions_active.set_function(lambda: len(self._by_id))

    def create(
        self,
        *,
        task_id: str | None = None,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        episode_id: str | None = None,
    ) -> Session:
        if episode_id is not None and episode_id in self._by_id:
            raise SessionError(409, f"episode {episode_id} already has an open session")
        if episode_id is not None and episode_id in self._ended:
            raise SessionError(409, f"episode {episode_id} has ended; episode ids are not reused")
        episode = Episode(
            id=episode_id or new_id("ep"),
            task_id=task_id or new_id("task"),
            group_id=group_id,
            metadata=dict(metadata or {}),
        )
        session = Session(episode=episode, key=new_key())
        self._by_key[session.key] = session
        self._by_id[episode.id] = session
        self.metrics.sessions.labels("created").inc()
        return session

    def by_key(self, key: str) -> Session | None:
        session = self._by_key.get(key)
        return session if session is not None and session.state == "open" else None

    def by_id(self, episode_id: str) -> Session | None:
        return self._by_id.get(episode_id)

    def ended(self, episode_id: str) -> EndedSession | None:
        """The outcome of a session that has ended (among the last ``MAX_ENDED_REMEMBERED``)."""
        return self._ended.get(episode_id)

    def owner_of(self, key: str) -> Session | EndedSession | None:
        """The session a key belongs to, whether open, being ended, or ended."""
        session = self._by_key.get(key)
        if session is not None:
            return session
        episode_id = self._ended_keys.get(key)
        return None if episode_id is None else self._ended.get(episode_id)

    def __len__(self) -> int:
        return len(self._by_id)

    # -- calls -------------------------------------------------------------------------------

    def begin_call(self, session: Session) -> None:
        session.inflight += 1
        session.idle.clear()
        session.last_active = time.monotonic()

    def end_call(self, session: Session) -> None:
        session.inflight -= 1
        session.last_active = time.monotonic()
        if session.inflight == 0:
            session.idle.set()

    def record(self, session: Session, turn: Turn, entry: HistoryEntry | None) -> None:
        session.episode.turns.append(turn)
        if entry is not None:
            session.history.append(entry)
        self.metrics.turns.inc()
        if self.host is not None:
            self.host.turn_recorded(session.episode.id, turn)

    # -- lifecycle -----------------------------------------------------------------------------

    def set_reward(self, session: Session, reward: float, turn_id: str | None = None) -> None:
        if session.state != "open":
            raise SessionError(409, f"episode {session.episode.id} has ended")
        check_reward(reward)
        session.last_active = time.monotonic()
        if turn_id is None:
            session.episode.reward = reward
            return
        for turn in session.episode.turns:
            if turn.id == turn_id:
                turn.reward = reward
                return
        raise SessionError(404, f"episode {session.episode.id} has no turn {turn_id}")

    async def end(
        self,
        session: Session,
        *,
        status: EpisodeStatus = EpisodeStatus.OK,
        reward: float | None = None,
        error: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Episode:
        """Close the session, wait for its calls in flight, and store the episode.

        Ending a session that has ended (or is being ended) returns the stored episode."""
        check_reward(reward)
        while session.state == "ending":  # another end is storing it: its outcome stands
            await session.settled.wait()
        if session.state == "ended":
            return session.episode
        session.state = "ending"  # refuse new calls with this key from now on
        session.settled.clear()
        try:
            await session.idle.wait()
            # The outcome goes on a copy, so that an end that is not acknowledged changes
            # nothing (the turns list is shared: calls have stopped).
            episode = session.episode.model_copy(
                update={
                    "status": status,
                    "reward": session.episode.reward if reward is None else reward,
                    "error": session.episode.error if error is None else error,
                    "metadata": {**session.episode.metadata, **(metadata or {})},
                    "ended": time.time(),
                }
            )
            if status == EpisodeStatus.OK and not episode.turns:  # nothing captured: never trains
                episode.status, episode.error = EpisodeStatus.FAILED, NO_MODEL_CALL
            if self.sink is not None:
                result = await asyncio.to_thread(self.sink.append, episode)
                if inspect.isawaitable(result):
                    await result
        except DuplicateEpisodeError as exc:  # no retry can store it: close the session
            self._close(session)
            raise SessionError(
                409, f"episode {session.episode.id} is already stored; ids are not reused"
            ) from exc
        except BaseException:
            session.state = "open"  # not acknowledged: the caller may retry the end
            raise
        finally:
            session.settled.set()
        session.episode = episode
        self._close(session)
        if episode.error == NO_MODEL_CALL:
            self.metrics.sessions.labels("no_model_call").inc()
        self.metrics.sessions.labels("ended").inc()
        if self.host is not None:
            self.host.episode_ended(episode)
        return episode

    def _close(self, session: Session) -> None:
        session.state = "ended"
        episode = session.episode
        self._by_key.pop(session.key, None)
        self._by_id.pop(episode.id, None)
        self._ended[episode.id] = EndedSession(
            episode.id, session.key, episode.status, episode.reward, len(episode.turns)
        )
        self._ended_keys[session.key] = episode.id
        while len(self._ended) > MAX_ENDED_REMEMBERED:
            _, old = self._ended.popitem(last=False)
            self._ended_keys.pop(old.key, None)

    async def reap_idle(self) -> int:
        """End, as failed, every open session without a call for ``idle_timeout_s``; returns
        how many were ended. Their turns are stored with the reason."""
        if self.idle_timeout_s is None:
            return 0
        cutoff = time.monotonic() - self.idle_timeout_s
        idle = [
            s
            for s in self._by_id.values()
            if s.state == "open" and s.inflight == 0 and s.last_active < cutoff
        ]
        reaped = 0
        for session in idle:
            if session.state != "open" or session.inflight or session.last_active >= cutoff:
                continue  # it moved while an earlier one was being stored
            try:
                await self.end(
                    session,
                    status=EpisodeStatus.FAILED,
                    error=f"session expired: idle for {self.idle_timeout_s:g} s, never ended",
                )
            except Exception as exc:  # the store is busy: try again on the next pass
                log.warning("could not end idle episode %s: %s", session.episode.id, exc)
                continue
            self.metrics.sessions.labels("expired").inc()
            reaped += 1
        return reaped

    async def reap_forever(self) -> None:
        """``reap_idle`` a few times per idle timeout, until cancelled."""
        if self.idle_timeout_s is None:
            return
        interval = min(max(self.idle_timeout_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_idle()
            except Exception:  # never let the reaper die quietly on one bad pass
                log.exception("reaping idle sessions failed")
