"""Trainer ranks as Ray actors on a local multi-node Ray cluster (one machine, CPU, gloo, the
tiny model): two DeepSpeed ZeRO-3 ranks on two nodes train as the single-process torch
backend does; a real ``areal-sdk train`` with two ranks trains every step once and serves
the pushed weights; a rank's actor killed mid-run stops the run with one ``error:`` line, and
``--resume`` finishes it; a seeded synchronous run stores the same episodes under ``ray`` as
under ``processes``."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_sdk.config import Config, ConfigError, load_config
from areal_sdk.store import TrajectoryStore
from tests.backends.train.common import (
    FIXED_SEQUENCE,
    loss_fn,
    micro_batches,
    single,
    train_config,
)
from tests.services.test_processes_run import LiveRun, _assert_trained_once

ray = pytest.importorskip("ray")
pytest.importorskip("deepspeed")
from ray.cluster_utils import Cluster  # noqa: E402

from areal_sdk.services.ray_trainer import RayTrainGroup  # noqa: E402

RANK_STARTS = re.compile(r"trainer rank (\d+) starts on node (\w+) \([^)]*\), pid (\d+)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head for the rollout workers and two nodes, each for an engine server and a trainer
    rank (custom resources tell them apart); all on this machine."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "resources": {"worker_slot": 2}},
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"engine_slot": 1, "trainer_slot": 1})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _group_config(cluster: Cluster, model_dir: Path, run_dir: Path) -> Config:
    train = train_config(
        backend="deepspeed",
        zero_stage=3,
        # Partition even the tiny model's small weights, so ZeRO-3 really gathers.
        deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "train": train.model_dump(),
            "run": {"placement": "ray", "dir": str(run_dir)},
            "ray": {
                "address": cluster.address,
                "strategy": "SPREAD",
                "trainer": {"ranks": 2, "num_cpus": 1, "resources": {"trainer_slot": 1}},
            },
        }
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_zero3_ranks_on_two_nodes_train_as_one_torch_process(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from areal_sdk.backends.train.torch_backend import TorchBackend

    reference = TorchBackend(tiny_model_dir, train_config())
    (one_rank,) = micro_batches(40)
    ref_losses = [reference.train_step(one_rank, loss_fn(k))["loss"] for k in range(3)]
    ref_state = {n: t.clone() for b in reference.state_for_sync(64 * 1024) for n, t in b}
    probe = [single(FIXED_SEQUENCE), single(FIXED_SEQUENCE[:9])]
    ref_probe = reference.forward_logprobs(probe)

    group = RayTrainGroup(_group_config(cluster, tiny_model_dir, tmp_path / "run"))
    try:
        assert group.world_size == 2 and group.rank == 0
        worker_nodes = {str(n.node_id) for n in cluster.worker_nodes}
        assert {n.node_id for n in group.nodes} == worker_nodes  # one rank on each node
        # The loop's rank-major list: rank 0's share, then rank 1's.
        shares = micro_batches(40, num_ranks=2)
        batches = [mb for share in shares for mb in share]
        losses = [group.train_step(batches, loss_fn(k))["loss"] for k in range(3)]
        assert group.step == 3 and group.version == 3
        torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-6)
        # Every weight, gathered whole from the ZeRO-3 shards, equal to the torch backend's.
        state = {n: t for b in group.state_for_sync(64 * 1024) for n, t in b}
        assert state.keys() == ref_state.keys()
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, ref_state[name], atol=1e-4, rtol=0, msg=name)
        # Logprobs come back in the order of the micro-batches, whichever rank ran them.
        got = group.forward_logprobs(probe)
        for mine, theirs in zip(got, ref_probe, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
        # Rank 0 writes the checkpoint on the shared path; every rank saves its shard.
        group.save(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "config.json").is_file()
    finally:
        group.close()
    assert not ray.is_initialized()  # the group left the cluster it joined


def _run_config(run_config: Any, cluster: Cluster, *, steps: int, **sections: dict) -> Path:
    settings: dict[str, dict] = {
        "run": {"steps": steps, "placement": "ray", "heartbeat_timeout_s": 5.0},
        "ray": {
            "address": cluster.address,
            "strategy": "SPREAD",
            "engine": {"num_cpus": 1, "resources": {"engine_slot": 1}},
            "worker": {"num_cpus": 0.5, "resources": {"worker_slot": 1}},
            "trainer": {"ranks": 2, "num_cpus": 1, "resources": {"trainer_slot": 1}},
        },
        "train": {"backend": "deepspeed", "zero_stage": 3},
        "inference": {"servers": 1},
        "rollout": {"workers": 1, "timeout_s": 60},
        "eval": {"before": False, "after": True},
    }
    for name, values in sections.items():
        settings.setdefault(name, {}).update(values)
    return run_config(**settings)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_run_trains_with_two_ranks_and_serves_their_weights(run_config, cluster) -> None:
    run = LiveRun(_run_config(run_config, cluster, steps=2))
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 2)
    ranks = {
        int(m.group(1)): m.group(2) for _, line in run.lines if (m := RANK_STARTS.search(line))
    }
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 2, run.output
    # The held-out episodes after training were sampled by the weights of step 2, which
    # rank 0 gathered from both ranks and the run pushed to the engine.
    with TrajectoryStore(run.run_dir) as store:
        assert store.highest_version() == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_stops_the_run_naming_it_and_resume_continues(run_config, cluster) -> None:
    steps = 5
    config = _run_config(
        run_config, cluster, steps=steps, eval={"after": False}, run={"checkpoint_every": 1}
    )
    run = LiveRun(config)
    run.wait_for("the first step", lambda: run.steps() >= 1)
    (pid,) = [
        int(m.group(3))
        for _, line in run.lines
        if (m := RANK_STARTS.search(line)) and m.group(1) == "1"
    ]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert run.finish(120) == 1, run.output
    errors = [line for when, line in run.lines if line.startswith("error:")]
    assert len(errors) == 1, run.output
    assert "trainer rank 1 on node" in errors[0] and "--resume" in errors[0], errors
    assert "Traceback" not in run.output
    run.line_after(killed_at, r"^error:")  # found within its bound, never a hang
    # The two ranks' ZeRO-3 checkpoint on the shared run directory resumes on a new group.
    resumed = LiveRun(config, "--resume")
    assert resumed.finish() == 0, resumed.output
    _assert_trained_once(resumed.run_dir, steps)


def test_several_ranks_need_deepspeed() -> None:
    with pytest.raises(ConfigError, match=r"ray\.trainer\.ranks=2 .* train\.backend=deepspeed"):
        load_config(None, ["ray.trainer.ranks=2"])
    with pytest.raises(ConfigError, match=r"ray\.trainer\.ranks: .*greater than or equal to 1"):
        load_config(None, ["ray.trainer.ranks=0", "train.backend=deepspeed"])
    cfg = load_config(None, ["ray.trainer.ranks=2", "train.backend=deepspeed"])
    assert cfg.ray.trainer.ranks == 2


SEEDED_AGENT = """
import zlib

import areal_sdk as areal
from openai import AsyncOpenAI


@areal.trace
async def solve(task):
    # A seed per task and sample: the same episode samples the same tokens in any placement.
    sample = int(areal.current_episode().episode.metadata["sample"])
    seed = zlib.crc32(str(task["id"]).encode()) * 16 + sample
    reply = await AsyncOpenAI().chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=6,
        seed=seed,
    )
    text = reply.choices[0].message.content or ""
    return float(len(text) % 3 == 0)
"""


def _store_contents(run_dir: Path) -> list[tuple[Any, ...]]:
    """What each step trained, placement-free: task, sample, tokens, versions, reward."""
    with TrajectoryStore(run_dir) as store:
        consumed = store.consumed_steps()
        episodes = list(store.iter())
    return sorted(
        (
            consumed.get(e.id),
            e.task_id,
            int(e.metadata["sample"]),
            e.status.value,
            e.reward,
            tuple(
                (tuple(t.prompt_ids), tuple(t.completion_ids), tuple(t.versions)) for t in e.turns
            ),
        )
        for e in episodes
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_and_processes_store_the_same_episodes_for_a_fixed_seed(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.training.conftest import write_run

    synchronous = {
        "rollout": {"workers": 1, "concurrency": 1, "max_staleness": 0, "timeout_s": 60},
        "inference": {"servers": 1},
        "eval": {"before": False, "after": False},
    }
    contents = {}
    for placement in ("processes", "ray"):
        where = tmp_path / placement
        where.mkdir()
        sections: dict[str, dict] = {
            **synchronous,
            "run": {"dir": str(where / "run"), "steps": 3, "placement": placement, "seed": 7},
        }
        if placement == "ray":
            sections["ray"] = {
                "address": cluster.address,
                "engine": {"num_cpus": 1, "resources": {"engine_slot": 1}},
                "worker": {"num_cpus": 0.5, "resources": {"worker_slot": 1}},
                "trainer": {"num_cpus": 1, "resources": {"trainer_slot": 1}},
            }
        config = write_run(where, tiny_model_dir, **sections)
        (where / "toy_agent.py").write_text(SEEDED_AGENT)
        run = LiveRun(config)
        assert run.finish() == 0, run.output
        contents[placement] = _store_contents(where / "run")
    trained = contents["ray"]
    assert all(turns and turns[0][1] for *_, turns in trained)  # every episode sampled tokens
    assert [c[0] for c in trained] == [0] * 4 + [1] * 4 + [2] * 4
    # Synchronous: step k trains episodes sampled by the weights of step k alone.
    assert all(set(v for *_, versions in c[5] for v in versions) == {c[0]} for c in trained)
    assert contents["ray"] == contents["processes"]


def test_each_rank_asks_ray_for_a_card_on_cuda_and_sees_it_as_its_own() -> None:
    from areal_sdk.services.ray_trainer import _portable, trainer_resources

    on_cuda = load_config(None, ["train.device=cuda:1", "ray.trainer.num_cpus=2"])
    assert trainer_resources(on_cuda) == {"CPU": 2.0, "GPU": 1.0}
    # Ray shows a rank only the card it gave it.
    assert _portable(on_cuda)["train"]["device"] == "cuda"
    assert trainer_resources(load_config(None, [])) == {"CPU": 1.0}
