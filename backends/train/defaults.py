"""The train backend's settings a user leaves unset, chosen for the device it trains on.

A user runs the defaults, so the defaults are the fast path (benchmarks/README.md, "Fast by
default"):

- ``train.compile``: on CUDA the decoder layers are compiled (1.45x on an H100 and an H200,
  and a quarter less activation memory; the first step pays ~15-60 s of compile, which the
  run announces). On a CPU compiling bought no measured speed and costs ~30 s, so it is off.
- ``train.micro_batch_tokens``: on CUDA as many tokens as a quarter-to-most of the card holds
  after the weights, gradients and AdamW moments (fewer, larger micro-batches: one 32k-token
  micro-batch ran 3% faster than two of 16k, and most of a step's host gaps go with them).
  On a CPU 8192, the size measured there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from areal_sdk.config import Config

CPU_MICRO_BATCH_TOKENS = 8192
# Bounds of an automatic CUDA micro-batch: below 2k tokens kernels are too small to fill a
# GPU; above 64k a step rarely holds more tokens, and one micro-batch already fills it.
MIN_AUTO_TOKENS = 2048
MAX_AUTO_TOKENS = 65536
# The share of the card the trainer plans for: most of it alone, under half where an engine
# on the same card holds its weights and KV cache.
SHARE_ALONE = 0.85
SHARE_WITH_ENGINE = 0.45
# Kept free for the logprob head's chunks, the allocator's fragmentation and the CUDA context.
HEADROOM_BYTES = 2 << 30
# Measured activation memory of an uncompiled layer over a compiled one (benchmarks/README.md:
# 35.0 GiB at 16k tokens uncompiled, 26.2 compiled, on the 0.5B shape).
UNCOMPILED_FACTOR = 1.7


def compile_by_default(setting: bool | None, device: torch.device) -> bool:
    """``train.compile`` as set, or on where it pays (CUDA)."""
    return setting if setting is not None else device.type == "cuda"


def engine_shares_device(config: Config) -> bool:
    """Whether an inference engine of this run sits on the trainer's card."""
    inference, train = config.inference, config.train
    if inference.urls:
        return False  # servers attached by address: their cards are not known to be this one
    if torch.device(inference.device).type != "cuda" or torch.device(train.device).type != "cuda":
        return False
    return _index(inference.device) == _index(train.device)


def _index(device: str) -> int:
    parsed = torch.device(device)
    return parsed.index if parsed.index is not None else 0


def activation_bytes_per_token(model_config: object, *, compiled: bool, checkpointing: bool) -> int:
    """What one token's activations hold for backward across the decoder, in bf16.

    Per layer ~2 x (8 x hidden + 3 x intermediate) bytes compiled (the norms' and attention's
    inputs and outputs, the MLP's gate, up and product), which matches the 0.5B shape's
    measured 1.0 MiB a token; with checkpointing only each layer's input is kept."""
    hidden = int(getattr(model_config, "hidden_size", 1024))
    inter = int(getattr(model_config, "intermediate_size", 4 * hidden))
    layers = int(getattr(model_config, "num_hidden_layers", 24))
    if checkpointing:
        return layers * 2 * hidden + 2 * (8 * hidden + 3 * inter)
    per_layer = 2 * (8 * hidden + 3 * inter)
    return int(layers * per_layer * (1.0 if compiled else UNCOMPILED_FACTOR))


def micro_batch_tokens_for(
    model: torch.nn.Module,
    device: torch.device,
    *,
    compiled: bool,
    checkpointing: bool,
    shares_device: bool,
    stored_softmax: bool = False,
    device_bytes: int | None = None,
) -> int:
    """Tokens per micro-batch for ``model`` training on ``device`` (see the module docstring).

    ``stored_softmax``: the logprob head keeps a bf16 row of the vocabulary per token until
    backward (``train.logprob_backend: stored``). ``device_bytes`` overrides the card's
    memory (tests)."""
    if device.type != "cuda" and device_bytes is None:
        return CPU_MICRO_BATCH_TOKENS
    if device_bytes is None:
        device_bytes = torch.cuda.get_device_properties(device).total_memory
    params = [p for p in model.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    # float32 weights, gradients and two AdamW moments for what trains; weights for the rest.
    states = 16 * trainable + 4 * frozen
    share = SHARE_WITH_ENGINE if shares_device else SHARE_ALONE
    budget = device_bytes * share - states - HEADROOM_BYTES
    # The HF model's config (the trainer's policy wraps it).
    config = getattr(model, "config", None) or getattr(
        getattr(model, "policy", None), "config", None
    )
    per_token = activation_bytes_per_token(config, compiled=compiled, checkpointing=checkpointing)
    if stored_softmax:
        per_token += 2 * int(getattr(config, "vocab_size", 0) or 0)
    tokens = int(budget // per_token) // 1024 * 1024
    return max(MIN_AUTO_TOKENS, min(MAX_AUTO_TOKENS, tokens))
