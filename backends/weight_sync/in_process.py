"""``in_process``: hand the named tensors to an engine object living in this process.

The buckets are collected into one mapping and loaded with a single
``engine.update_weights(tensors, version)``, so the engine switches versions once, atomically,
between two of its steps (and flushes its cache once). The engine copies the values into its
own parameters: nothing is shared with the trainer after the call returns. With the torch
backend and ZeRO 0-2 the mapping holds views of the live weights, so it costs no memory
beyond what a ``weights.dtype`` cast allocates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch
from areal_sdk.backends.weight_sync.base import (
    NamedTensors,
    WeightSync,
    cast_bucket,
    check_engine_version,
)

from areal_sdk.inference import InferenceBackend


class InProcessSync(WeightSync):
    """Weights into an ``InferenceBackend`` object of this process."""

    method = "in_process"

    def __init__(
        self,
        engine: InferenceBackend,
        *,
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        trainer_rank: int = 0,
    ) -> None:
        super().__init__(timeout_s=timeout_s, dtype=dtype, trainer_rank=trainer_rank)
        if engine is None:
            raise ValueError("the in_process weight sync needs the engine object (engine=...)")
        self.engine = engine

    @property
    def _peer(self) -> str:
        return f"the in-process engine {type(self.engine).__name__}"

    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        tensors: dict[str, torch.Tensor] = {}
        for bucket in state:
            for name, t in cast_bucket(bucket, self.dtype):
                tensors[name] = t
        if not tensors:
            raise self._fail(version, self._peer, "the trainer produced no tensors")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        try:
            await asyncio.wait_for(self.engine.update_weights(tensors, version), self.timeout_s)
        except TimeoutError:
            raise self._fail(
                version, self._peer, f"update_weights did not finish within {self.timeout_s:g} s"
            ) from None
        except Exception as exc:
            raise self._fail(version, self._peer, f"update_weights failed: {exc}") from exc
        check_engine_version(self, self.engine, version, self._peer)
        return len(tensors), nbytes
