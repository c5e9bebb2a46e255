"""in_process and disk syncs into the real embedded engine: its logprobs equal the trainer's."""

from __future__ import annotations

from pathlib import Path

import torch
from areal_sdk.backends.embedded.engine import EmbeddedEngine
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync.disk import DiskSync
from areal_sdk.backends.weight_sync.in_process import InProcessSync

from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config


async def engine_logprobs(engine: EmbeddedEngine) -> torch.Tensor:
    return torch.tensor([x or 0.0 for x in await engine.score(FIXED_SEQUENCE)])


async def test_in_process_then_disk_sync_make_engine_match_trainer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = EmbeddedEngine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32")
    trainer = TorchBackend(tiny_model_dir, train_config())
    batches = micro_batches(40)[0]
    try:
        syncs = [
            InProcessSync(engine, timeout_s=30),
            DiskSync(engine, tmp_path / "w", keep_last=2, model_dir=tiny_model_dir, timeout_s=30),
        ]
        for sync in syncs:
            for _ in range(2):
                trainer.train_step(batches, loss_fn(trainer.step))
                result = await sync.push(trainer.state_for_sync(32 * 1024), trainer.version)
                assert result is not None and result.version == trainer.version
                assert engine.version == trainer.version
                expected = trainer.forward_logprobs([single(FIXED_SEQUENCE)])[0]
                torch.testing.assert_close(
                    await engine_logprobs(engine), expected, atol=1e-4, rtol=0
                )
        # keep_last=2: only the two newest version directories remain, each a full HF dir.
        kept = sorted(p.name for p in (tmp_path / "w").iterdir())
        assert kept == ["v000003", "v000004"]
        assert (tmp_path / "w" / "v000004" / "config.json").is_file()
    finally:
        await engine.close()
