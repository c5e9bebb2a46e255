"""An engine process hosting a weight-sync receiver (spawned by the tests)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tests.backends.train.common import FIXED_SEQUENCE


async def _connected_engine(method: str, model_dir: str, port: int, per_bucket: bool):  # type: ignore[no-untyped-def]
    """An embedded engine on CPU and its ``method`` receiver, joined to the trainer."""
    from areal_sdk.backends.embedded.engine import EmbeddedEngine

    if method == "broadcast":
        from areal_sdk.backends.weight_sync.broadcast import BroadcastReceiver as Receiver
    else:
        from areal_sdk.backends.weight_sync.cuda_ipc import CudaIpcReceiver as Receiver
    engine = EmbeddedEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    receiver = Receiver(engine, port=port, timeout_s=30, apply_per_bucket=per_bucket)
    await receiver.connect()
    return engine, receiver


def serve(method: str, model_dir: str, port: int, out: Any, syncs: int, per_bucket: bool) -> None:
    async def run() -> None:
        engine, receiver = await _connected_engine(method, model_dir, port, per_bucket)
        for _ in range(syncs):
            version = await receiver.receive_one(idle_timeout_s=60)
            out.put((version, engine.version, await engine.score(FIXED_SEQUENCE)))
        await engine.close()

    asyncio.run(run())


def serve_then_die(method: str, model_dir: str, port: int, out: Any) -> None:
    """Take one sync, report it, then die without a goodbye (a crashed engine process)."""

    async def run() -> None:
        _, receiver = await _connected_engine(method, model_dir, port, per_bucket=False)
        out.put(await receiver.receive_one(idle_timeout_s=60))
        out.close()
        out.join_thread()  # flush the report before dying
        os._exit(1)

    asyncio.run(run())
