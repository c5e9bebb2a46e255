"""A server killed in the middle of a broadcast push: the trainer's push fails with
``PeerLostError``, the server is out of rotation, and ``WeightPusher`` pushes the version again
to the server left, which then serves the trainer's weights.

As in ``test_processes.py``, ``python -m sglang.launch_server`` is a mock (a fake ``sglang``
package that serves the embedded engine); the processes, HTTP and the gloo group are real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.sglang import SGLangBackend
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync import PeerLostError, make_weight_sync

from areal_sdk.config import Config
from areal_sdk.plugin_host import get_host
from areal_sdk.training_run import WeightPusher
from tests.backends.sglang.conftest import launched_servers, launching_config
from tests.backends.sglang.test_processes import _scores
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config


@pytest.fixture
def launched(
    tiny_model_dir: Path, fake_sglang_path: Path, tmp_path: Path
) -> Iterator[tuple[SGLangBackend, Config]]:
    cfg = launching_config(tiny_model_dir, tmp_path / "run", request_timeout_s=30)
    with launched_servers(cfg, fake_sglang_path) as backend:
        yield backend, cfg


class KillingTrainer:
    """A trained trainer whose first weight read kills a server after its first bucket
    (small buckets: the push is many broadcasts, and the kill lands between two)."""

    def __init__(self, model_dir: str, kill: Callable[[], None]) -> None:
        self.trainer = TorchBackend(Path(model_dir), train_config())
        self.trainer.train_step(micro_batches(40)[0], loss_fn(self.trainer.step))
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
    victim, survivor = backend.launcher.urls
    killing = KillingTrainer(cfg.model.path, lambda: backend.launcher.kill(0))
    sync = make_weight_sync("broadcast", cfg, engine=backend)
    with pytest.raises(PeerLostError) as err:
        await sync.push(killing.state_for_sync(0), killing.trainer.version)
    assert err.value.lost == [victim] and victim in str(err.value)
    assert [s.url for s in backend.pool.live] == [survivor]
    await sync.close()


async def test_the_trainer_pushes_again_to_the_servers_left(launched) -> None:
    backend, cfg = launched
    survivor = backend.launcher.urls[1]
    killing = KillingTrainer(cfg.model.path, lambda: backend.launcher.kill(0))
    pusher = WeightPusher(cfg, backend, killing, get_host())  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(pusher(killing.trainer.version), 90)
    finally:
        await pusher.sync.close()
    assert killing.reads == 2
    assert backend.version == killing.trainer.version
    assert [s.url for s in backend.pool.live] == [survivor]
    got, version = await _scores(survivor)
    assert version == str(killing.trainer.version)
    expected = killing.trainer.forward_logprobs([single(FIXED_SEQUENCE)])[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
