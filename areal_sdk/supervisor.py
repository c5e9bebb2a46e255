"""Keep an in-process engine serving: detect that it died, rebuild it with the latest weights.

``SupervisedEngine`` stands in for the engine everywhere (gateway, weight pushes). When a
call fails and the engine's ``health()`` says it is dead, the engine is rebuilt from its
factory, the newest trained weights are loaded into it under their version, and the call is
retried once on the new engine. A periodic ``watch()`` finds a dead engine between calls.
Requests that were running when it died fail (their episodes fail alone); the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from areal_sdk.compute_threads import call_in_fresh_thread, in_fresh_thread
from areal_sdk.inference import (
    GenerateOutput,
    InferenceBackend,
    PauseMode,
    SamplingParams,
    WeightSource,
)

log = logging.getLogger(__name__)

# Returns the weights to load into a rebuilt engine and their version (None: the initial ones).
LatestWeights = Callable[[], Awaitable[tuple[WeightSource, int] | None]]


class EngineRestartError(RuntimeError):
    """The engine died and could not be rebuilt."""


class SupervisedEngine(InferenceBackend):
    """An ``InferenceBackend`` that rebuilds its engine when the engine dies."""

    def __init__(
        self,
        factory: Callable[[], InferenceBackend],
        *,
        latest_weights: LatestWeights | None = None,
        on_restart: Callable[[str], None] | None = None,
        max_restarts: int = 3,
    ) -> None:
        self._factory = factory
        # Built (and rebuilt) on a thread that exits: see ``compute_threads``.
        self._engine = call_in_fresh_thread(factory)
        self.latest_weights = latest_weights
        self.on_restart = on_restart or (lambda message: log.warning(message))
        self.max_restarts = max_restarts
        self.restarts = 0
        self.tokenizer = self._engine.tokenizer
        self.model_name = self._engine.model_name
        # A thread lock, not an asyncio one: the gateway's thread and the run's loop both
        # call in, and an asyncio.Lock contended from two event loops raises.
        self._restarting = threading.Lock()

    @property
    def engine(self) -> InferenceBackend:
        return self._engine

    def __getattr__(self, name: str) -> Any:  # engine-specific extras (max_model_len, ...)
        return getattr(self.__dict__["_engine"], name)

    @property
    def version(self) -> int:
        return self._engine.version

    async def _alive(self, engine: InferenceBackend) -> bool:
        try:
            await engine.health()
        except Exception:
            return False
        return True

    async def restart_if_dead(self) -> bool:
        """Rebuild the engine if it is dead; True when it was rebuilt.

        The rebuild runs in a task of its own: a caller cancelled meanwhile (a request whose
        client left) does not stop it halfway, with the dead engine closed and no new one in
        its place."""
        return await asyncio.shield(asyncio.ensure_future(self._rebuild_if_dead()))

    async def _rebuild_if_dead(self) -> bool:
        dead = self._engine
        while not self._restarting.acquire(blocking=False):  # never blocks either loop
            await asyncio.sleep(0.05)
        try:
            return await self._rebuild(dead)
        finally:
            self._restarting.release()

    async def _rebuild(self, dead: InferenceBackend) -> bool:
        if self._engine is not dead or await self._alive(dead):
            return False  # another caller rebuilt it already, or it lives
        if self.restarts >= self.max_restarts:
            raise EngineRestartError(
                f"the engine died again after {self.restarts} restarts; giving up"
            )
        self.restarts += 1
        reason = "unknown"
        try:
            await dead.health()
        except Exception as exc:
            reason = str(exc)
        self.on_restart(f"the engine died ({reason}); restart {self.restarts}")
        try:
            await dead.close()
        except Exception:  # it is dead: closing is best effort
            log.debug("closing the dead engine failed", exc_info=True)
        fresh = await in_fresh_thread(self._factory)
        weights = await self.latest_weights() if self.latest_weights else None
        if weights is not None:
            source, version = weights
            await fresh.update_weights(source, version)
        self._engine = fresh
        self.on_restart(f"the engine serves again at weight version {fresh.version}")
        return True

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine
        try:
            return await getattr(engine, method)(*args, **kwargs)
        except Exception:
            if engine is self._engine and await self._alive(engine):
                raise  # the engine is fine: the request itself failed
            await self.restart_if_dead()
            return await getattr(self._engine, method)(*args, **kwargs)

    async def watch(self, every_s: float = 2.0) -> None:
        """Check the engine's health every ``every_s`` seconds, rebuilding it when dead."""
        while True:
            await asyncio.sleep(every_s)
            await self.restart_if_dead()

    # -- InferenceBackend ------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> GenerateOutput:
        return await self._call("generate", input_ids, sampling, request_id=request_id)

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for chunk in self._engine.stream(*args, **kwargs):  # type: ignore[attr-defined]
            yield chunk

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def update_weights(self, source: WeightSource, version: int) -> None:
        await self._call("update_weights", source, version)

    async def health(self) -> dict[str, Any]:
        status = await self._engine.health()
        return {**status, "restarts": self.restarts}

    async def close(self) -> None:
        await self._engine.close()
