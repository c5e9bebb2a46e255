"""``weights.method=broadcast`` under ``run.placement=ray``, on a local three-node Ray cluster
(one machine, CPU, gloo, the tiny model): the run's process is rank 0 of a process group with
the engine servers on the other nodes and sends every version through it; a short ``train``
run trains every step once. An engine server killed (it comes back on a new actor) or added
is caught up from disk, and the next version reaches it through the group built again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from areal_sdk.backends.weight_sync import make_weight_sync
from transformers import AutoModelForCausalLM

from areal_sdk.config import load_config
from areal_sdk.services.health import Phase
from areal_sdk.services.placement import for_placement
from areal_sdk.store import TrajectoryStore
from tests.services.test_processes_run import LiveRun, _assert_trained_once

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from areal_sdk.services.ray_engines import RayEngineFleet  # noqa: E402
from areal_sdk.services.ray_placement import RayPlacement  # noqa: E402

BOUND_S = 5.0  # run.heartbeat_timeout_s in these runs


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head for the rollout workers and the trainer, two nodes for engine servers."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "resources": {"worker_slot": 4, "trainer_slot": 1},
        },
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"engine_slot": 2})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _broadcast_config(run_config: Any, cluster: Cluster, *, steps: int) -> Any:
    return run_config(
        run={
            "steps": steps,
            "placement": "ray",
            "heartbeat_timeout_s": BOUND_S,
            "checkpoint_every": 1,
        },
        ray={
            "address": cluster.address,
            "strategy": "SPREAD",  # one engine server on each engine node
            "engine": {"num_cpus": 1, "resources": {"engine_slot": 1}},
            "worker": {"num_cpus": 0.5, "resources": {"worker_slot": 1}},
            "trainer": {"num_cpus": 0.5, "resources": {"trainer_slot": 1}},
        },
        weights={"method": "broadcast", "timeout_s": 60},
        inference={"servers": 2},
        rollout={"workers": 2, "retries": 1, "timeout_s": 60},
        eval={"before": False, "after": False},
    )


def _served(url: str) -> int:
    """The weight version the engine server at ``url`` serves (-1 if it does not answer)."""
    try:
        reply = httpx.get(url + "/get_weight_version", timeout=10)
        return int(reply.json()["weight_version"])
    except (httpx.HTTPError, KeyError, ValueError):
        return -1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_run_with_broadcast_weights_trains_every_step_once(run_config, cluster):
    steps = 3
    run = LiveRun(_broadcast_config(run_config, cluster, steps=steps))
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, steps)
    assert not (run.run_dir / "weights").exists()  # nothing went through the disk method
    with TrajectoryStore(run.run_dir) as store:
        versions = {v for e in store.iter() for t in e.turns for v in t.versions}
    # max_staleness 1: the last step's episodes were sampled by a pushed version.
    assert max(versions) >= 1, versions


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_an_engine_restarted_or_added_gets_the_next_version_through_the_group(
    cluster, tiny_model_dir, tmp_path
):
    cfg = for_placement(
        load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                "inference.device=cpu",
                "inference.servers=2",
                "inference.max_model_len=256",
                f"ray.address={cluster.address}",
                "ray.strategy=SPREAD",
                "ray.engine.num_cpus=0.5",
                "ray.engine.resources={engine_slot: 1}",
                "weights.method=broadcast",
                "weights.timeout_s=60",
                f"run.dir={tmp_path}",
                f"run.heartbeat_timeout_s={BOUND_S}",
            ],
        ),
        "ray",
    )
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    version = 0

    def weights(v: int) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach() + 0.01 * v) for n, p in trainer.named_parameters()]

    async def latest() -> tuple[dict[str, torch.Tensor], int] | None:
        return (dict(weights(version)), version) if version else None

    placement = RayPlacement(cfg).connect(engines=2, workers=0)
    fleet = RayEngineFleet(cfg, placement=placement, run_dir=tmp_path, latest_weights=latest)
    sync = None
    try:
        placement.reserve(engines=2, workers=0, timeout_s=120)
        await asyncio.to_thread(fleet.start)
        sync = make_weight_sync("broadcast", cfg, engine=fleet.backend)
        version = 1
        await sync.push([weights(version)], version)
        assert set((await fleet.backend.served_versions()).values()) == {1}
        killed = fleet.members[0]
        old_url = killed.url
        os.kill(killed.state.pid, signal.SIGKILL)  # the server process, on this machine
        deadline = time.monotonic() + 300
        while not (killed.state.phase == Phase.UP and killed.url != old_url):
            assert time.monotonic() < deadline, "the killed engine server never came back"
            await fleet.check()
            await asyncio.sleep(0.5)
        added = await fleet.add()  # one more actor, as `areal-sdk engines add` starts
        assert {s.url for s in fleet.backend.pool.live} == {m.url for m in fleet.members}
        version = 2
        await sync.push([weights(version)], version)
        served = {m.url: _served(m.url) for m in fleet.members}
        assert set(served) >= {killed.url, added} and set(served.values()) == {2}, served
    finally:
        if sync is not None:
            await sync.close()
        await fleet.backend.close()
        fleet.stop()
        placement.close()


def test_broadcast_under_ray_dials_the_run_at_this_nodes_ip(monkeypatch):
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    cfg = for_placement(load_config(None, ["weights.method=broadcast"]), "ray")
    assert (cfg.weights.method, cfg.weights.master_addr) == ("broadcast", "10.0.0.1")
    chosen = load_config(None, ["weights.method=broadcast", "weights.master_addr=head.cluster"])
    assert for_placement(chosen, "ray").weights.master_addr == "head.cluster"
