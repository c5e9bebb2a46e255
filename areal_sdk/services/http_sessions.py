"""Sessions over the gateway's ``/rl/sessions`` routes, for a gateway in another process (a
``SessionClient``).

The same steps as ``InProcessSessions`` (``areal_sdk/launcher.py``), as HTTP calls with the
admin token: ``open`` creates the session and returns its key; ``end`` records the turn
rewards, ends the session (the gateway stores the episode before it answers) and reads the
stored episode back from the store, so what the trainer gets is exactly what was committed.

A gateway keeps its open sessions in memory: one that died, or was restarted, has lost them.
Such an episode fails alone, stored as failed with ``GATEWAY_LOST_SESSION`` as its error;
nothing is retried forever and every call has a deadline.

>>> sessions = HttpSessions(gateway_url, admin_token, store, run_id="train")  # doctest: +SKIP
>>> key = await sessions.open(episode)          # the agent's API key
>>> stored = await sessions.end(ctx)            # the episode as committed, with its turns
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from areal_sdk.store import DuplicateEpisodeError, StoreError, TrajectoryStore
from areal_sdk.tracing import EpisodeContext
from areal_sdk.trajectory import Episode, EpisodeStatus

log = logging.getLogger(__name__)

GATEWAY_LOST_SESSION = "the gateway restarted; its open session for this episode was lost"
# The gateway could not be reached, or dropped the call: it died (its sessions with it).
_GATEWAY_GONE = (httpx.TransportError,)
# /end answers 503 while the store is busy: the session stays open, so it is tried again.
_END_ATTEMPTS = 5


class GatewayUnavailable(ConnectionError):
    """The gateway did not answer within the deadline; the message names it."""


class HttpSessions:
    """A ``SessionClient`` over the gateway at ``base_url``.

    ``store`` is the run's ``TrajectoryStore`` (the file the gateway writes), opened in this
    process. ``open_wait_s`` bounds how long ``open`` waits for a gateway that is restarting
    (its socket stays bound, so calls queue until it serves again); ``timeout_s`` bounds each
    other call, ``/end`` included (it waits for the session's calls in flight to finish).
    """

    def __init__(
        self,
        base_url: str,
        admin_token: str,
        store: TrajectoryStore,
        *,
        run_id: str = "train",
        timeout_s: float = 120.0,
        open_wait_s: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.store = store
        self.run_id = run_id
        self.open_wait_s = open_wait_s
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> httpx.AsyncClient:
        # One client, reused: a connection pool belongs to the loop that opened it.
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.is_closed or self._loop is not loop:
            self._http = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self._timeout
            )
            self._loop = loop
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    async def _post(self, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return await self._client().post(route, json=body)

    # -- SessionClient ------------------------------------------------------------------------

    async def open(self, episode: Episode) -> str:
        episode.metadata["run_id"] = self.run_id
        body = {
            "task_id": episode.task_id,
            "group_id": episode.group_id,
            "episode_id": episode.id,
            "metadata": episode.metadata,
        }
        deadline = asyncio.get_running_loop().time() + self.open_wait_s
        delay = 0.2
        while True:
            try:
                response = await self._post("/rl/sessions", body)
                break
            except httpx.ConnectError as exc:
                # Never reached the gateway, so nothing was created: safe to send again.
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise GatewayUnavailable(
                        f"the gateway at {self.base_url} did not answer within "
                        f"{self.open_wait_s:g} s ({type(exc).__name__}: {exc})"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except httpx.TransportError as exc:
                raise GatewayUnavailable(
                    f"the gateway at {self.base_url} dropped the session request "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
        if response.status_code != 200:
            raise GatewayUnavailable(
                f"the gateway refused a session ({response.status_code}): {_message(response)}"
            )
        return str(response.json()["api_key"])

    async def end(self, ctx: EpisodeContext) -> Episode:
        ep = ctx.episode
        base = f"/rl/sessions/{ep.id}"
        try:
            for turn_id, value in ctx.turn_rewards.items():
                r = await self._post(f"{base}/reward", {"reward": value, "turn_id": turn_id})
                if r.status_code == 404:
                    return await self._lost(ep, "the gateway no longer knows it")
                if r.status_code == 409:  # the agent ended it already: /end answers as then
                    break
                if r.status_code != 200:
                    log.warning("reward for episode %s not recorded: %s", ep.id, _message(r))
            body = {
                "status": ep.status.value,
                "reward": ep.reward,
                "error": ep.error,
                "metadata": ep.metadata,
            }
            why = ""
            for attempt in range(_END_ATTEMPTS):
                r = await self._post(f"{base}/end", body)
                if r.status_code == 200:
                    _warn_if_ended_before(ep, r.json())
                    return await asyncio.to_thread(self.store.get, ep.id)
                if r.status_code == 404:
                    return await self._lost(ep, "the gateway no longer knows it")
                why = f"{r.status_code}: {_message(r)}"
                if r.status_code != 503:
                    break
                await asyncio.sleep(0.2 * 2**attempt)  # the store was busy: the session stays open
        except _GATEWAY_GONE as exc:
            return await self._lost(ep, f"{type(exc).__name__}: {exc}")
        # The gateway refused to end it: keep the outcome (without turns) rather than drop it.
        return await self._store_failed(
            ep, ep.error or f"gateway could not end the episode ({why})"
        )

    async def _lost(self, ep: Episode, why: str) -> Episode:
        """The gateway lost the session. If the old gateway stored the episode first (its
        agent ended it, or it was ended just before the gateway died), that stands."""
        try:
            return await asyncio.to_thread(self.store.get, ep.id)
        except StoreError:
            pass
        log.warning("episode %s failed: %s (%s)", ep.id, GATEWAY_LOST_SESSION, why)
        # The agent's own error, if any, is the symptom (its calls got 401 or no answer).
        then = f"; the agent then failed: {ep.error}" if ep.error else ""
        return await self._store_failed(ep, GATEWAY_LOST_SESSION + then)

    async def _store_failed(self, ep: Episode, error: str) -> Episode:
        ep.status = EpisodeStatus.FAILED
        ep.error = error[:300]
        try:
            await asyncio.to_thread(self.store.append, ep, run_id=self.run_id)
        except DuplicateEpisodeError:  # the gateway stored it after all: that one stands
            return await asyncio.to_thread(self.store.get, ep.id)
        return ep


def _warn_if_ended_before(ep: Episode, ack: dict[str, Any]) -> None:
    if ep.reward is not None and ack.get("reward") != ep.reward:
        log.warning(
            "episode %s was ended before its agent returned, with reward %s; "
            "the reward %s given after that is not used",
            ep.id,
            ack.get("reward"),
            ep.reward,
        )


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:300]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(data)[:300]
