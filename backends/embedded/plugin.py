"""Registers the embedded engine as the inference backend ``embedded``.

Entry point (pyproject): ``embedded_engine = "areal_sdk.backends.embedded.plugin"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from areal_sdk.hookspecs import hookimpl

if TYPE_CHECKING:
    from areal_sdk.backends.embedded.engine import EmbeddedEngine

    from areal_sdk.config import Config


def create_engine(config: Config) -> EmbeddedEngine:
    """Build an ``EmbeddedEngine`` from the ``model`` and ``inference`` config sections."""
    from areal_sdk.backends.embedded.engine import EmbeddedEngine, EngineConfig

    source = config.model.path or config.model.name
    if source is None:
        raise ValueError("the embedded engine needs model.path or model.name")
    inference = config.inference
    return EmbeddedEngine.from_pretrained(
        source,
        device=inference.device,
        dtype=config.model.dtype,
        tokenizer=config.model.tokenizer,
        model_name=config.model.served_name,
        config=EngineConfig(
            max_batch_size=inference.max_batch_size,
            max_model_len=inference.max_model_len,
            prefill_chunk=inference.prefill_chunk,
            cuda_graphs=inference.cuda_graphs,
            recompute_kv_on_update=inference.recompute_kv_on_update,
        ),
    )


@hookimpl
def areal_inference_backends() -> Mapping[str, Callable[..., Any]]:
    return {"embedded": create_engine}
