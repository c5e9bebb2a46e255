"""A run's only engine server dies just before a weight push: the push waits for the fleet to
restart it and brings it to the new weights, instead of ending the run (``inference.servers``
is 1 by default)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from areal_sdk.config import Config
from areal_sdk.services.engine_fleet import EngineFleet
from areal_sdk.services.health import RestartPolicy
from tests.services.test_engine_fleet import Weights

pytestmark = pytest.mark.slow


@pytest.fixture
def lone_fleet(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[EngineFleet, Weights]]:
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "inference": {
                "servers": 1,
                "max_batch_size": 4,
                "max_model_len": 128,
                "launch_timeout_s": 240,
                "request_timeout_s": 60,
                "retries": 1,
            },
            "run": {"dir": str(tmp_path)},
        }
    )
    weights = Weights(tiny_model_dir, tmp_path / "pushed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        fleet = EngineFleet(
            cfg,
            run_dir=tmp_path,
            policy=RestartPolicy(max_restarts=3, window_s=300),
            heartbeat_timeout_s=5.0,
            latest_weights=weights,
        ).start()
    try:
        yield fleet, weights
    finally:
        fleet.stop()


async def test_a_push_to_a_dead_lone_server_waits_for_its_restart(lone_fleet) -> None:
    fleet, weights = lone_fleet
    backend = fleet.backend
    await backend.update_weights(weights.make(1), 1)
    watcher = asyncio.create_task(fleet.watch(poll_s=0.5))
    try:
        old_pid = fleet.members[0].state.pid
        fleet.kill(0)
        await backend.update_weights(weights.make(2), 2)  # no server in rotation right now
        member = fleet.members[0]
        assert member.state.pid != old_pid and member.state.restarts == 1
        info = httpx.get(member.url + "/get_model_info", timeout=30).json()
        assert info["weight_version"] == "2" and backend.version == 2
        assert [s["alive"] for s in backend.servers()] == [True]
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
