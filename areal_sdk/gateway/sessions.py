"""Per-episode sessions: an unguessable key ties API calls to one episode's turns.

``POST /rl/sessions`` creates a session and returns its key; a call made with that key as its
API key is recorded as a ``Turn`` of that episode and may continue only that episode's earlier
turns. Ending a session waits for its calls in flight, hands the finished ``Episode`` to the
sink (``sink.append(episode)``, which commits it) and only then acknowledges; from then on the
key is refused.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from areal_sdk.gateway.conversation import Message
from areal_sdk.gateway.metrics import GatewayMetrics
from areal_sdk.gateway.templating import HistoryEntry
from areal_sdk.tracing import NO_MODEL_CALL
from areal_sdk.trajectory import Episode, EpisodeStatus, Turn, new_id

KEY_PREFIX = "sk-areal-"
# previous_response_id keeps this many responses per session (oldest forgotten first)
MAX_STORED_RESPONSES = 256


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

    def __post_init__(self) -> None:
        self.idle.set()

    def remember_response(self, response_id: str, conversation: list[Message]) -> None:
        self.responses[response_id] = conversation
        while len(self.responses) > MAX_STORED_RESPONSES:
            self.responses.popitem(last=False)


class SessionError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SessionManager:
    """Sessions by key and by episode id; one event loop, so no locks are needed."""

    def __init__(self, sink: EpisodeSink | None, metrics: GatewayMetrics, host: Any = None) -> None:
        self.sink = sink
        self.metrics = metrics
        self.host = host
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, Session] = {}

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
        self.metrics.sessions_active.inc()
        return session

    def by_key(self, key: str) -> Session | None:
        session = self._by_key.get(key)
        return session if session is not None and session.state == "open" else None

    def by_id(self, episode_id: str) -> Session | None:
        return self._by_id.get(episode_id)

    def __len__(self) -> int:
        return len(self._by_id)

    # -- calls -------------------------------------------------------------------------------

    def begin_call(self, session: Session) -> None:
        session.inflight += 1
        session.idle.clear()

    def end_call(self, session: Session) -> None:
        session.inflight -= 1
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
        """Close the session, wait for its calls in flight, and store the episode."""
        if session.state != "open":
            raise SessionError(409, f"episode {session.episode.id} has already ended")
        session.state = "ending"  # refuse new calls with this key from now on
        await session.idle.wait()
        episode = session.episode
        episode.status = status
        if reward is not None:
            episode.reward = reward
        if error is not None:
            episode.error = error
        if status == EpisodeStatus.OK and not episode.turns:  # nothing captured: never trains
            episode.status, episode.error = EpisodeStatus.FAILED, NO_MODEL_CALL
            self.metrics.sessions.labels("no_model_call").inc()
        if metadata:
            episode.metadata.update(metadata)
        episode.ended = time.time()
        if self.sink is not None:
            try:
                result = await asyncio.to_thread(self.sink.append, episode)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                session.state = "open"  # not acknowledged: the caller may retry the end
                raise
        session.state = "ended"
        self._by_key.pop(session.key, None)
        self._by_id.pop(episode.id, None)
        self.metrics.sessions.labels("ended").inc()
        self.metrics.sessions_active.dec()
        if self.host is not None:
            self.host.episode_ended(episode)
        return episode
