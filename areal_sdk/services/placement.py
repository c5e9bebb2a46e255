"""Which placement a run uses, and what it implies for the rest of the config.

``run.placement: auto`` resolves to ``processes`` when the engine or the trainer is on CUDA
and to ``inprocess`` on CPU: on a GPU the services' Python must not share one interpreter
(the asynchronous gain goes to the GIL, ``benchmarks/README.md``), while on a CPU the engine,
the trainer and the agents share the same few cores whichever process they are in, and
separate processes only add copies of the model (``benchmarks/README.md``, "Placement").
"""

from __future__ import annotations

from typing import Literal

from areal_sdk.config import Config

Placement = Literal["inprocess", "processes", "ray"]


class PlacementError(ValueError):
    """A placement the config cannot run; the message says what to change."""


def on_cuda(cfg: Config) -> bool:
    return cfg.inference.device.startswith("cuda") or cfg.train.device.startswith("cuda")


def resolve_placement(cfg: Config) -> Placement:
    if cfg.run.placement == "auto":
        return "processes" if on_cuda(cfg) else "inprocess"
    return cfg.run.placement


def for_placement(cfg: Config, placement: Placement) -> Config:
    """``cfg`` as ``placement`` runs it: in ``processes`` the trainer is a process of its own
    and weights reach the engine servers across processes (``in_process`` becomes CUDA IPC on
    a GPU, safetensors on disk on a CPU). ``ray`` places them on a cluster, with weights on
    disk under the run directory, which every node must see, or broadcast from this node."""
    if placement == "ray":
        return _for_ray(cfg)
    if placement == "inprocess":
        if cfg.inference.servers > 1:
            raise PlacementError(
                f"inference.servers={cfg.inference.servers} needs run.placement=processes "
                "(in one process there is one engine)"
            )
        return cfg
    updates: dict[str, object] = {}
    if cfg.train.separate_process is False:
        raise PlacementError(
            "run.placement=processes runs the trainer in a process of its own; "
            "remove train.separate_process=false or use run.placement=inprocess"
        )
    train = cfg.train.model_copy(update={"separate_process": True})
    updates["train"] = train
    if cfg.weights.method == "in_process":
        weights: dict[str, object] = {"method": "disk"}
        if cfg.train.device.startswith("cuda"):
            weights["method"] = "cuda_ipc"
            if cfg.weights.dtype == "auto":
                # What the engine holds on CUDA (``auto`` is bfloat16 there): the handles then
                # share tensors the engine copies as they are, at half a float32 push's bytes.
                weights["dtype"] = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
        updates["weights"] = cfg.weights.model_copy(update=weights)
    return cfg.model_copy(update=updates)


def _for_ray(cfg: Config) -> Config:
    """Engine servers, rollout workers and trainer ranks as Ray actors; weights reach the
    servers on other machines as safetensors in the run directory (a shared path), or by
    ``broadcast`` from the run's process at an address every node reaches; ``cuda_ipc``
    where every actor shares this machine's GPUs."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise PlacementError(
            'run.placement=ray needs Ray: pip install "areal-sdk[ray]" (on every node)'
        )
    if cfg.train.separate_process is False:
        raise PlacementError(
            "run.placement=ray runs the trainer in a process of its own; "
            "remove train.separate_process=false"
        )
    if cfg.weights.method not in ("in_process", "disk", "broadcast", "cuda_ipc"):
        raise PlacementError(
            f"weights.method={cfg.weights.method} does not reach engine servers on other "
            "machines; run.placement=ray pushes weights with disk (the run directory, "
            "shared), broadcast, or cuda_ipc on one machine"
        )
    if cfg.weights.method == "cuda_ipc" and not (
        cfg.train.device.startswith("cuda") and cfg.inference.device.startswith("cuda")
    ):
        raise PlacementError(
            "weights.method=cuda_ipc shares GPU memory: it needs train.device and "
            "inference.device on CUDA"
        )
    train = cfg.train.model_copy(update={"separate_process": True})
    if cfg.weights.method == "cuda_ipc":
        # One machine whose GPUs the actors share (fractional num_gpus): trainer rank 0
        # hands its buckets to this process as IPC handles, which passes them on to the
        # engine servers (every one on this node; a handle opens nowhere else).
        update: dict[str, object] = {}
        if cfg.weights.dtype == "auto":
            update["dtype"] = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
    elif cfg.weights.method == "broadcast":
        from areal_sdk.services.ray_placement import reachable_addr

        # The run's process is rank 0 of the weight group: engines on every node dial it.
        update = {"master_addr": reachable_addr(cfg.weights.master_addr)}
    else:  # in_process (the default) or disk
        update = {"method": "disk"}
    weights = cfg.weights.model_copy(update=update)
    return cfg.model_copy(update={"train": train, "weights": weights})
