"""The built-in train backends and weight-sync methods, registered like any plugin's.

Entry point: ``train = "areal_sdk.backends.train.plugin"`` in ``[project.entry-points.areal_sdk]``.
Nothing heavy is imported here: each factory imports its backend when it is called, so a
missing ``deepspeed`` only matters to a config that asks for it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from areal_sdk.hookspecs import PluginStatus, hookimpl

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.inference import InferenceBackend


def _torch_backend(config: Config) -> Any:
    from areal_sdk.backends.train.torch_backend import TorchBackend

    return TorchBackend.from_config(config)


def _deepspeed_backend(config: Config) -> Any:
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            'train.backend=deepspeed needs DeepSpeed: pip install "areal-sdk[deepspeed]"'
        )
    from areal_sdk.backends.train.deepspeed_backend import DeepSpeedBackend

    return DeepSpeedBackend.from_config(config)


def _sync_factory(method: str) -> Callable[..., Any]:
    def factory(config: Config, *, engine: InferenceBackend | None = None, **kwargs: Any) -> Any:
        from areal_sdk.backends.weight_sync import make_weight_sync

        return make_weight_sync(method, config, engine=engine, **kwargs)

    factory.__name__ = f"{method}_weight_sync"
    factory.__doc__ = f"The {method!r} weight sync: ``factory(config, engine=...)``."
    return factory


@hookimpl
def areal_plugin_status() -> PluginStatus | None:
    if importlib.util.find_spec("deepspeed") is None:
        return PluginStatus(
            True,
            kind="train backend",
            reason='torch only; the deepspeed backend needs pip install "areal-sdk[deepspeed]"',
            extra="deepspeed",
        )
    return PluginStatus(True, kind="train backend")


@hookimpl
def areal_train_backends() -> Mapping[str, Callable[..., Any]]:
    return {"torch": _torch_backend, "deepspeed": _deepspeed_backend}


@hookimpl
def areal_weight_sync_methods() -> Mapping[str, Callable[..., Any]]:
    return {m: _sync_factory(m) for m in ("in_process", "disk", "broadcast", "cuda_ipc")}
