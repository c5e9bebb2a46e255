"""A slot-based KV cache and the attention function that reads and writes it.

Each running request owns one *slot*: a row of preallocated key/value tensors, one pair per
layer, of shape ``[num_slots, kv_heads, max_len + 1, head_dim]``. Position ``max_len`` is a
scratch column: padded tokens and idle decode rows write there, and no real query attends to
it. A step's batch is ragged, ``[rows, tokens]``: row ``r`` feeds ``tokens`` new ids of slot
``slots[r]`` starting at its own position, so one code path serves chunked prefill (one or a
few rows of many tokens) and decode (many rows of one token).

The attention function is registered with transformers' ``AttentionInterface`` under
``areal_slots``; the model's own modules (projections, RoPE, MLP) run unchanged, and the
step's context reaches every layer as the ``areal_step`` keyword argument. Without that
argument (a plain ``model(input_ids)`` call) it is ordinary SDPA attention.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "areal_slots"
# Every SDPA backend but cuDNN, for prefill (see slot_attention).
_PREFILL_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class SlotKVCache:
    """Preallocated per-slot keys and values for every layer."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.scratch = max_len  # the column padded tokens write to
        shape = (num_slots, kv_heads, max_len + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass
class StepContext:
    """What the attention function needs for one forward pass.

    ``slot_index`` and ``write_pos`` are ``[rows, tokens]``: where each new token's key and
    value go. ``mask`` is ``[rows, 1, tokens, kv_len]``: which cached positions each query
    sees. ``rows_are_slots`` means row ``r`` is slot ``r`` (decode), so the cache is read as a
    view instead of gathered.
    """

    cache: SlotKVCache
    slots: torch.Tensor  # [rows]
    slot_index: torch.Tensor  # [rows, tokens]
    write_pos: torch.Tensor  # [rows, tokens]
    mask: torch.Tensor  # [rows, 1, tokens, kv_len] bool
    kv_len: int
    rows_are_slots: bool


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    areal_step: StepContext | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Write this step's keys/values into their slots, then attend over each slot's prefix."""
    if areal_step is None:
        # Called as a plain HF model (a reference forward pass, a scoring call): behave as SDPA.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    step = areal_step
    layer = module.layer_idx
    k_cache = step.cache.keys[layer]
    v_cache = step.cache.values[layer]
    # key/value are [rows, kv_heads, tokens, head_dim]; indexing with two [rows, tokens]
    # tensors around a slice yields [rows, tokens, kv_heads, head_dim].
    k_cache[step.slot_index, :, step.write_pos] = key.transpose(1, 2).to(k_cache.dtype)
    v_cache[step.slot_index, :, step.write_pos] = value.transpose(1, 2).to(v_cache.dtype)
    rows, heads, width, head_dim = query.shape
    if step.rows_are_slots:
        keys = k_cache[:rows, :, : step.kv_len]
        values = v_cache[:rows, :, : step.kv_len]
    else:
        # Slice before gathering: only the first kv_len positions of each row are copied.
        keys = k_cache[:, :, : step.kv_len].index_select(0, step.slots)
        values = v_cache[:, :, : step.kv_len].index_select(0, step.slots)
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    mask = step.mask
    if groups > 1:
        # Grouped-query attention without repeating K/V: the query heads that share one KV
        # head become extra query positions of that head (rows g*width + t), so SDPA runs
        # as plain multi-head attention over kv_heads heads.
        query = query.reshape(rows, kv_heads, groups * width, head_dim)
        mask = mask.repeat(1, 1, groups, 1) if width > 1 else mask
    # Prefill shapes change every step. cuDNN's SDPA plans a graph per new shape (about
    # 2.5 ms of host time per layer on an H200, 100 ms a prefill step for 24 layers); the
    # memory-efficient kernel needs no plan. Decode shapes are fixed per graph.
    backends = contextlib.nullcontext() if step.rows_are_slots else sdpa_kernel(_PREFILL_BACKENDS)
    with backends:
        out = F.scaled_dot_product_attention(
            query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask, scale=scaling
        )
    out = out.reshape(rows, heads, width, head_dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
# Outside the engine the model builds SDPA masks as usual, so it stays a working HF model.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
