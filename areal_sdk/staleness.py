"""Bounded staleness: AReaL's admission rule, enforced before an episode starts.

With ``batch`` episodes per step and bound ``max_staleness``, at most
``(max_staleness + version + 1) * batch`` episodes are ever admitted while the policy is at
``version``, so rollouts run at most ``max_staleness`` steps ahead of the trainer;
``max_staleness = 0`` is the synchronous baseline (a batch is admitted only after the
previous one trained). Episodes finish out of order, so the bound is also checked when a
group is trained: one admitted under version ``v`` trains at step ``t`` only if
``t - v <= max_staleness`` (``is_fresh``), else it is dropped.

Episodes that fail, or that the trainer drops (dynamic filtering), give their slot back so
the rollout side keeps producing usable data.

Versions here count the trainer's updates (its step). They are the weight versions of a run
that never lost weights to a crash; a resumed run's weights skip the numbers of the lost
ones, and staleness stays a count of updates.
"""

from __future__ import annotations

import asyncio


class StalenessController:
    """Counts admitted episodes against the capacity that the current version allows."""

    def __init__(
        self, *, batch_size: int, max_staleness: int, version: int = 0, admitted: int = 0
    ) -> None:
        if batch_size < 1 or max_staleness < 0:
            raise ValueError("batch_size must be >= 1 and max_staleness >= 0")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self._version = version
        self._admitted = admitted
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        return self._version

    @property
    def admitted(self) -> int:
        return self._admitted

    def capacity(self) -> int:
        """How many more episodes may start now."""
        limit = (self.max_staleness + self._version + 1) * self.batch_size
        return limit - self._admitted

    async def acquire(self) -> int:
        """Wait for a slot; return the version the episode starts under."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.capacity() > 0)
            self._admitted += 1
            return self._version

    async def give_back(self, n: int = 1) -> None:
        """Return slots of episodes that will never train (failed, filtered out)."""
        async with self._changed:
            self._admitted -= n
            self._changed.notify_all()

    async def set_version(self, version: int) -> None:
        """The trainer finished a step: more episodes may start."""
        async with self._changed:
            self._version = version
            self._changed.notify_all()

    def is_fresh(self, start_version: int, step: int) -> bool:
        """May an episode started under ``start_version`` train at ``step``?"""
        return step - start_version <= self.max_staleness
