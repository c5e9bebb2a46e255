"""A server killed in the middle of a broadcast push: the trainer's push fails with
``PeerLostError``, the server is out of rotation, and ``WeightPusher`` pushes the version again
to the server left, which then serves the trainer's weights.

As in ``test_processes.py``, ``python -m sglang.launch_server`` is a mock (a fake ``sglang``
package that serves the embedded engine); the processes, HTTP and the gloo group are real.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.sglang import SGLangBackend
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync import PeerLostError, make_weight_sync

from areal_sdk.config import Config
from areal_sdk.plugin_host import get_host
from areal_sdk.training_run import WeightPusher
from tests.backends.sglang.test_processes import _scores
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config


@pytest.fixture
def launched(
    tiny_model_dir: Path, fake_sglang_path: Path, tmp_path: Path
) -> Iterator[tuple[SGLangBackend, Config]]:
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "inference": {
                "backend": "sglang",
                "sglang_python": sys.executable,
                "sglang_servers": 2,
                "launch_timeout_s": 120,
                "request_timeout_s": 30,
            },
            "weights": {"method": "broadcast", "timeout_s": 30},
            "run": {"dir": str(tmp_path / "run")},
        }
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(fake_sglang_path))
        mp.setenv("OMP_NUM_THREADS", "1")
        backend = get_host().inference_backend("sglang")(cfg)
    try:
        yield backend, cfg
    finally:
        asyncio.run(backend.close())


class KillingTrainer:
    """The trainer, whose first weight read kills a server after its first bucket (small
    buckets: the push is many broadcasts, and the kill lands between two)."""

    def __init__(self, trainer: TorchBackend, kill: callable) -> None:  # type: ignore[valid-type]
        self.trainer = trainer
        self.kill = kill
        self.reads = 0

    def state_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        self.reads += 1
        for index, bucket in enumerate(self.trainer.state_for_sync(32 * 1024)):
            if index == 1 and self.reads == 1:
                self.kill()
            yield bucket


async def test_a_server_killed_mid_broadcast_is_named_and_leaves_rotation(launched) -> None:
    backend, cfg = launched
    launcher = backend.launcher
    victim, survivor = launcher.urls
    trainer = TorchBackend(Path(cfg.model.path), train_config())
    trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))

    # The sync alone: the loss is named, and the victim is out of rotation.
    killing = KillingTrainer(trainer, lambda: launcher.kill(0))
    sync = make_weight_sync("broadcast", cfg, engine=backend)
    with pytest.raises(PeerLostError) as err:
        await sync.push(killing.state_for_sync(0), trainer.version)
    assert err.value.lost == [victim] and victim in str(err.value)
    assert [s.url for s in backend.pool.live] == [survivor]
    await sync.close()


async def test_the_trainer_pushes_again_to_the_servers_left(launched) -> None:
    backend, cfg = launched
    launcher = backend.launcher
    victim, survivor = launcher.urls
    trainer = TorchBackend(Path(cfg.model.path), train_config())
    trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
    killing = KillingTrainer(trainer, lambda: launcher.kill(0))
    pusher = WeightPusher(cfg, backend, killing, get_host())  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(pusher(trainer.version), 90)
    finally:
        await pusher.sync.close()
    assert killing.reads == 2
    assert backend.version == trainer.version
    assert [s.url for s in backend.pool.live] == [survivor]
    got, version = await _scores(survivor)
    assert version == str(trainer.version)
    expected = trainer.forward_logprobs([single(FIXED_SEQUENCE)])[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
