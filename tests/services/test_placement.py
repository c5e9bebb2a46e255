"""``run.placement``: what ``auto`` resolves to, and what ``processes`` implies."""

from __future__ import annotations

import pytest

from areal_sdk.config import load_config
from areal_sdk.services.placement import PlacementError, for_placement, resolve_placement


def test_auto_is_processes_on_cuda_and_inprocess_on_cpu():
    assert resolve_placement(load_config(None, [])) == "inprocess"
    assert resolve_placement(load_config(None, ["train.device=cuda"])) == "processes"
    assert resolve_placement(load_config(None, ["inference.device=cuda:1"])) == "processes"
    assert resolve_placement(load_config(None, ["run.placement=processes"])) == "processes"


def test_processes_moves_the_trainer_out_and_weights_across_processes():
    cpu = for_placement(load_config(None, []), "processes")
    assert cpu.train.separate_process is True and cpu.weights.method == "disk"
    gpu = for_placement(load_config(None, ["train.device=cuda"]), "processes")
    assert gpu.weights.method == "cuda_ipc" and gpu.weights.dtype == "bfloat16"
    chosen = for_placement(load_config(None, ["weights.method=broadcast"]), "processes")
    assert chosen.weights.method == "broadcast"  # a method the user chose stays


def test_ray_keeps_cuda_ipc_for_actors_sharing_one_machines_gpus():
    pytest.importorskip("ray")
    cuda = ["train.device=cuda", "inference.device=cuda", "weights.method=cuda_ipc"]
    ipc = for_placement(load_config(None, cuda), "ray")
    assert ipc.weights.method == "cuda_ipc" and ipc.weights.dtype == "bfloat16"
    assert for_placement(load_config(None, cuda[:2]), "ray").weights.method == "disk"


@pytest.mark.parametrize(
    ("overrides", "placement", "message"),
    [
        (["train.separate_process=false"], "processes", "train.separate_process=false"),
        (["inference.servers=2"], "inprocess", "inference.servers=2 needs"),
        (["weights.method=cuda_ipc"], "ray", "cuda_ipc shares GPU memory: it needs"),
    ],
)
def test_placements_a_config_cannot_run_say_what_to_change(overrides, placement, message):
    with pytest.raises(PlacementError, match=message):
        for_placement(load_config(None, overrides), placement)
