"""``run.placement=ray`` end to end on a local three-node Ray cluster (one machine, CPU, the
tiny model): a real ``areal-sdk train`` joins the cluster, its engine servers and rollout
workers land on the nodes the config asks for, and a node that leaves mid-run (and a
rollout worker actor that crashes) costs neither a step nor an accepted episode: each is
replaced (the engine server on a live node, as Ray finds room)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from areal_sdk.cli.status import live_services
from areal_sdk.config import load_config
from areal_sdk.services.placement import PlacementError, for_placement
from tests.services.test_processes_run import LiveRun, _assert_trained_once

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

BOUND_S = 5.0  # run.heartbeat_timeout_s in these runs
PLACED = re.compile(r"(engine server engine-\d+|rollout worker \d+) (?:starts|runs) on node (\w+)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head (where rollout workers and the trainer may go) and two nodes for engine
    servers, told apart by custom resources; all on this machine."""
    node = {"num_cpus": 2}
    head = {"worker_slot": 4, "trainer_slot": 1}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "include_dashboard": False, "resources": head},
    )
    try:
        for name in ("a", "b"):
            cluster.add_node(**node, resources={"engine_slot": 2, f"node_{name}": 1})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _ray_config(run_config: Any, cluster: Cluster, *, steps: int, **sections: dict) -> Any:
    settings: dict[str, dict] = {
        "run": {
            "steps": steps,
            "placement": "ray",
            "heartbeat_timeout_s": BOUND_S,
            "checkpoint_every": 1,
        },
        "ray": {
            "address": cluster.address,
            "strategy": "SPREAD",  # the two engine servers on two nodes
            "engine": {"num_cpus": 1, "resources": {"engine_slot": 1}},
            "worker": {"num_cpus": 0.5, "resources": {"worker_slot": 1}},
            "trainer": {"num_cpus": 0.5, "resources": {"trainer_slot": 1}},
        },
        "inference": {"servers": 2},
        "rollout": {"workers": 2, "retries": 1, "timeout_s": 60},
        "eval": {"before": False, "after": False},
    }
    for name, values in sections.items():
        settings.setdefault(name, {}).update(values)
    return run_config(**settings)


def _placements(run: LiveRun) -> dict[str, str]:
    """Service -> the (short) id of the node it started on last, from the run's output."""
    out: dict[str, str] = {}
    for _, line in run.lines:
        if match := PLACED.search(line):
            out[match.group(1)] = match.group(2)
    return out


def _short(node: Any) -> str:
    return str(node.node_id)[:12]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_run_places_each_service_where_the_config_asks(run_config, cluster):
    config = _ray_config(run_config, cluster, steps=2)
    run = LiveRun(config)
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 2)
    placed = _placements(run)
    engines = {placed["engine server engine-0"], placed["engine server engine-1"]}
    workers = {placed["rollout worker 0"], placed["rollout worker 1"]}
    # Spread over the nodes that declared engine_slot; the workers where worker_slot is.
    assert engines == {_short(n) for n in cluster.worker_nodes}, run.output
    assert workers == {_short(cluster.head_node)}, run.output
    status = subprocess.run(
        ["areal-sdk", "status", str(run.run_dir)], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and "engine-1" in status.stdout, status.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_run_stopped_with_sigterm_keeps_its_last_step(run_config, cluster):
    config = _ray_config(run_config, cluster, steps=200)
    run = LiveRun(config)
    run.wait_for("the first step", lambda: run.steps() >= 1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(300) == 128 + signal.SIGTERM, run.output
    assert "interrupted by SIGTERM: checkpoint of step" in run.output, run.output
    assert "SIGTERM received" not in run.output  # Ray's own handler stayed out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_node_and_a_crashed_worker_cost_no_step_and_no_episode(run_config, cluster):
    # Long enough to outlive the restart of the server that was on the node.
    config = _ray_config(run_config, cluster, steps=40)
    run = LiveRun(config)
    run.wait_for("the first step", lambda: run.steps() >= 1)
    worker = run.service("rollout_worker")
    os.kill(worker["pid"], signal.SIGKILL)  # an actor's process crashes
    first = _placements(run)["engine server engine-0"]
    (node,) = [n for n in cluster.worker_nodes if _short(n) == first]
    cluster.remove_node(node, allow_graceful=False)  # the machine is gone, as in a crash
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 40)
    recorded, _ = live_services(run.run_dir)  # the run has ended: its last states
    restarts = {s["name"]: s["restarts"] for s in recorded["services"]}
    assert restarts["engine-0"] >= 1 and restarts[worker["name"]] >= 1, restarts


def test_ray_placement_pushes_weights_through_the_shared_run_directory():
    cfg = for_placement(load_config(None, []), "ray")
    assert cfg.weights.method == "disk" and cfg.train.separate_process is True


def test_ray_placement_without_ray_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    with pytest.raises(PlacementError, match=r'pip install "areal-sdk\[ray\]"'):
        for_placement(load_config(None, []), "ray")


def test_each_kind_asks_ray_for_its_resources_and_an_engine_on_cuda_for_a_gpu():
    from areal_sdk.services.ray_placement import RayPlacement

    cfg = load_config(
        None,
        [
            "inference.device=cuda",
            "ray.engine.num_gpus=0.5",
            "ray.worker.num_cpus=2",
            "ray.worker.resources={agent_node: 1}",
        ],
    )
    placement = RayPlacement(cfg)
    assert placement.resources("engine") == {"CPU": 1.0, "GPU": 0.5}
    assert placement.resources("worker") == {"CPU": 2.0, "agent_node": 1.0}
    on_cuda = RayPlacement(load_config(None, ["inference.device=cuda"]))
    assert on_cuda.resources("engine") == {"CPU": 1.0, "GPU": 1.0}


def test_an_engine_command_leaves_what_only_its_node_knows_to_the_actor():
    import sys

    from areal_sdk.services.ray_engines import HOST, PORT, PYTHON, _portable

    command = [sys.executable, "-m", "areal_sdk", "engine", "--host", "127.0.0.1"]
    command += ["--port", "4000", "--device", "cuda:3"]
    assert _portable(command) == [
        PYTHON, "-m", "areal_sdk", "engine", "--host", HOST, "--port", PORT, "--device", "cuda"
    ]  # fmt: skip


def test_a_wildcard_gateway_address_is_advertised_at_this_nodes_ip(monkeypatch):
    from areal_sdk.services.ray_stack import _reachable

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    assert _reachable("http://0.0.0.0:8000") == "http://10.0.0.1:8000"
    assert _reachable("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert _reachable("http://head.cluster:8000") == "http://head.cluster:8000"
