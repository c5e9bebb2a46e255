"""Trainer-to-engine weight sync: ``in_process``, ``disk``, ``broadcast``, ``cuda_ipc``.

``make_weight_sync(method, config, engine=...)`` builds the trainer side from the
``weights`` section; the engine side of ``broadcast`` and ``cuda_ipc`` is a receiver the
engine process hosts (``BroadcastReceiver``, ``CudaIpcReceiver``). Every method's ``push``
raises ``WeightSyncError`` instead of hanging, and returns only once the engine serves the
pushed version.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_sdk.backends.weight_sync.base import (
    PeerLostError,
    SyncResult,
    WeightSync,
    WeightSyncError,
    sync_dtype,
)

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.inference import InferenceBackend

METHODS = ("in_process", "disk", "broadcast", "cuda_ipc")

__all__ = [
    "METHODS",
    "PeerLostError",
    "SyncResult",
    "WeightSync",
    "WeightSyncError",
    "make_weight_sync",
]


def make_weight_sync(
    method: str,
    config: Config,
    *,
    engine: InferenceBackend | None = None,
    trainer_rank: int = 0,
    **overrides: Any,
) -> WeightSync:
    """The trainer side of ``method``, configured from ``config.weights``.

    ``engine`` is required by ``in_process`` and ``disk`` (the object whose
    ``update_weights`` loads the new version); ``overrides`` replace constructor arguments.
    """
    # An engine behind HTTP (SGLang) may bring its own trainer side for a method.
    engine_sync = getattr(engine, "weight_sync_for", None)
    if engine_sync is not None:
        sync = engine_sync(method, config, trainer_rank=trainer_rank, **overrides)
        if sync is not None:
            return sync
    w = config.weights
    common: dict[str, Any] = {
        "timeout_s": w.timeout_s,
        "dtype": sync_dtype(w.dtype),
        "trainer_rank": trainer_rank,
    }
    if method == "in_process":
        from areal_sdk.backends.weight_sync.in_process import InProcessSync

        return InProcessSync(engine, **{**common, **overrides})  # type: ignore[arg-type]
    if method == "disk":
        from areal_sdk.backends.weight_sync.disk import DiskSync

        args = {
            "keep_last": w.keep_last,
            "model_dir": config.model.path,
            **common,
            **overrides,
        }
        directory = args.pop("directory", w.dir or str(Path(config.run.dir) / "weights"))
        return DiskSync(engine, directory, **args)  # type: ignore[arg-type]
    channel_args = {
        "engine_ranks": w.engine_ranks,
        "master_addr": w.master_addr,
        "master_port": w.master_port,
        "device": config.train.device,
        **common,
    }
    if method == "broadcast":
        from areal_sdk.backends.weight_sync.broadcast import BroadcastSync

        return BroadcastSync(backend=w.group_backend, **{**channel_args, **overrides})
    if method == "cuda_ipc":
        from areal_sdk.backends.weight_sync.cuda_ipc import CudaIpcSync

        return CudaIpcSync(**{**channel_args, **overrides})
    raise WeightSyncError(f"unknown weight sync method {method!r}; known: {', '.join(METHODS)}")
