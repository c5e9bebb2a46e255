"""Registers the embedded engine as the inference backend ``embedded``.

Entry point (pyproject): ``embedded_engine = "areal_sdk.backends.embedded.plugin"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from areal_sdk.hookspecs import hookimpl

log = logging.getLogger(__name__)

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
        dtype=_dtype_that_runs(config.model.dtype, inference.device),
        tokenizer=config.model.tokenizer,
        model_name=config.model.served_name,
        config=EngineConfig(
            max_batch_size=inference.max_batch_size,
            max_model_len=inference.max_model_len,
            prefill_chunk=inference.prefill_chunk,
            idle_prefill_chunk=inference.idle_prefill_chunk,
            cuda_graphs=inference.cuda_graphs,
            prompt_hold_steps=inference.prompt_hold_steps,
            overlap_decode=inference.overlap_decode,
            recompute_kv_on_update=inference.recompute_kv_on_update,
            reuse_prefixes=inference.reuse_prefixes,
        ),
    )


def _dtype_that_runs(dtype: str, device: str) -> str:
    """``model.dtype`` as this machine runs it: bfloat16 on a CPU without native bf16
    products (AVX2 only), where they run tens of times slower, becomes float32."""
    import torch
    from areal_sdk.backends.train.torch_backend import bf16_runs_fast

    if dtype == "bfloat16" and not bf16_runs_fast(torch.device(device)):
        log.warning(
            "model.dtype is bfloat16, but this CPU has no native bfloat16 matrix products: "
            "the engine runs in float32"
        )
        return "float32"
    return dtype


@hookimpl
def areal_inference_backends() -> Mapping[str, Callable[..., Any]]:
    return {"embedded": create_engine}
