"""broadcast (gloo) and cuda_ipc (CPU shared memory) between two real processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync.base import WeightSyncError
from areal_sdk.backends.weight_sync.broadcast import BroadcastSync
from areal_sdk.backends.weight_sync.cuda_ipc import CudaIpcSync

from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config
from tests.backends.weight_sync.engine_worker import serve, serve_then_die


async def test_a_sync_nobody_joins_fails_within_its_timeout_naming_the_engine() -> None:
    sync = BroadcastSync(timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"engine rank 1 \(store 127\.0\.0\.1:\d+\)"):
        await sync.push([], 1)
    assert time.monotonic() - start < 10


@pytest.mark.slow
@pytest.mark.parametrize(("method", "per_bucket"), [("broadcast", False), ("cuda_ipc", True)])
async def test_engine_process_matches_trainer_after_each_sync(
    tiny_model_dir: Path, method: str, per_bucket: bool
) -> None:
    trainer = TorchBackend(tiny_model_dir, train_config())
    batches = micro_batches(40)[0]
    sync = (
        BroadcastSync(timeout_s=30)
        if method == "broadcast"
        else CudaIpcSync(device="cpu", timeout_s=30)
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(
        target=serve, args=(method, str(tiny_model_dir), sync.open_store(), out, 2, per_bucket)
    )
    proc.start()
    try:
        await sync.connect()
        for _ in range(2):
            trainer.train_step(batches, loss_fn(trainer.step))
            result = await sync.push(trainer.state_for_sync(32 * 1024), trainer.version)
            assert result is not None and result.version == trainer.version
            version, engine_version, scores = await asyncio.to_thread(out.get, True, 60)
            assert version == engine_version == trainer.version
            expected = trainer.forward_logprobs([single(FIXED_SEQUENCE)])[0]
            got = torch.tensor([x or 0.0 for x in scores])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        await sync.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["broadcast", "cuda_ipc"])
async def test_a_sync_whose_engine_died_fails_within_its_timeout_naming_it(
    tiny_model_dir: Path, method: str
) -> None:
    trainer = TorchBackend(tiny_model_dir, train_config())
    timeout = 8.0
    sync = (
        BroadcastSync(timeout_s=timeout)
        if method == "broadcast"
        else CudaIpcSync(device="cpu", timeout_s=timeout)
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(
        target=serve_then_die, args=(method, str(tiny_model_dir), sync.open_store(), out)
    )
    proc.start()
    try:
        await sync.connect()
        await sync.push(trainer.state_for_sync(32 * 1024), 1)
        assert await asyncio.to_thread(out.get, True, 60) == 1
        await asyncio.to_thread(proc.join, 30)
        assert proc.exitcode == 1  # the engine process is gone
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"engine|peer|rank 1") as failure:
            await sync.push(trainer.state_for_sync(32 * 1024), 2)
        assert time.monotonic() - start < timeout + 10
        assert "2" in str(failure.value)  # the version that could not be pushed
    finally:
        if proc.is_alive():
            proc.kill()
        await sync.close()
