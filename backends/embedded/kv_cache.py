"""A slot-based KV cache and the attention function that reads and writes it.

Each running request owns one *slot*: a row of preallocated key/value tensors, one pair per
layer, of shape ``[num_slots, kv_heads, max_len + 1, head_dim]``. Position ``max_len`` is a
scratch column: padded tokens and idle decode rows write there, and no real query attends to
it. A step's batch is ragged, ``[rows, tokens]``: row ``r`` feeds ``tokens`` new ids of slot
``slots[r]`` starting at its own position, so one code path serves chunked prefill (one or a
few rows of many tokens) and decode (many rows of one token).

A prefill step may instead be *packed*: all its new tokens in one row, with the sequence
boundaries of the queries and of the keys (each sequence's cached prefix, then its new
tokens) for the flash varlen kernel. Padded rows pay for the longest row and a dense mask
over the whole prefix; a packed step pays for its tokens only (``PackedRows``).

On CPU a decode step's rows attend through ``cpu_kernels.decode_attention`` (each row over
its own slot's first ``lengths[r]`` positions, no mask), and the fused decoder writes keys
and values itself (``cpu_kernels.rope_write``) before calling ``attend_cached``.

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
from areal_sdk.backends.embedded import cpu_kernels
from areal_sdk.backends.train.varlen_attention import flash_varlen
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

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Slot ``target`` takes slot ``source``'s first ``length`` positions (prefix_reuse)."""
        for cache in (*self.keys, *self.values):
            cache[target, :, :length].copy_(cache[source, :, :length])


@dataclass
class PackedRows:
    """The layout of a packed prefill step: ``T`` new tokens of ``S`` sequences in one row.

    Sequence ``s`` feeds ``cu_q[s+1] - cu_q[s]`` queries and attends over
    ``cu_k[s+1] - cu_k[s]`` keys: its cached prefix and its new tokens, which
    ``key_slots`` / ``key_pos`` (``[sum of key lengths]``) gather from the cache after this
    step's keys are written. ``starts`` (host ints) is where each sequence's new tokens begin.
    """

    cu_q: torch.Tensor  # [S+1] int32
    cu_k: torch.Tensor  # [S+1] int32
    max_q: int
    max_k: int
    key_slots: torch.Tensor  # [K] int64
    key_pos: torch.Tensor  # [K] int64
    starts: list[int]
    flash: bool  # the flash varlen kernel; else causal SDPA per sequence


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
    packed: PackedRows | None = None
    # Decode steps on CPU, and on CUDA with ``flash_decode``: how many cached positions each
    # row attends over.
    lengths: torch.Tensor | None = None
    # Decode through the flash kernel over each row's own prefix (``flash_decode``).
    flash_decode: bool = False


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
    return attend_cached(step, layer, query, scaling)


def attend_cached(
    step: StepContext, layer: int, query: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, None]:
    """``slot_attention`` after the step's keys and values are in layer ``layer``'s cache:
    ``query [rows, heads, tokens, head_dim]`` over each row's slot prefix; returns
    ``[rows, tokens, heads, head_dim]``."""
    k_cache = step.cache.keys[layer]
    v_cache = step.cache.values[layer]
    if step.packed is not None:
        keys = k_cache[step.packed.key_slots, :, step.packed.key_pos]  # [K, kv_heads, dim]
        values = v_cache[step.packed.key_slots, :, step.packed.key_pos]
        return _packed_attention(query[0].transpose(0, 1), keys, values, step.packed, scaling)
    rows, heads, width, head_dim = query.shape
    if step.flash_decode and step.lengths is not None and width == 1 and step.rows_are_slots:
        out = flash_decode(query[:, :, 0], k_cache, v_cache, step.lengths, step.kv_len, scaling)
        return out.unsqueeze(1), None
    if step.lengths is not None and width == 1 and cpu_kernels.usable(query):
        out = cpu_kernels.decode_attention(
            query[:, :, 0],
            k_cache,
            v_cache,
            step.slots,
            step.lengths,
            scaling if scaling is not None else head_dim**-0.5,
        )
        return out.unsqueeze(1), None
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


def flash_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    max_len_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """One query per row (``[rows, heads, dim]``, row r is slot r) over the first
    ``lengths[r]`` cached positions of its slot, through the flash varlen kernel; returns
    ``[rows, heads, dim]``. GQA native.

    A masked SDPA over a cache bucket reads every row up to the bucket's length and repeats
    nothing useful past each row's end; this reads each row's own prefix only. The cache is
    ``[slots, kv_heads, positions, dim]``: viewed as ``[rows of dim, kv_heads, dim]`` with the
    head stride of the cache, slot ``r``'s positions are rows ``r * kv_heads * positions``
    onwards, which is where ``cu_seqlens_k`` starts it; ``seqused_k`` (the lengths) bounds
    it, so the next boundary is never read."""
    slots, kv_heads, positions, dim = k_cache.shape
    rows = query.shape[0]
    # The view's last row ends exactly at the cache's last element (as_strided checks it).
    span = (slots - 1) * kv_heads * positions + positions
    strides = (dim, positions * dim, 1)
    keys = k_cache.as_strided((span, kv_heads, dim), strides)
    values = v_cache.as_strided((span, kv_heads, dim), strides)
    starts = torch.arange(rows + 1, device=query.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(
        query,
        keys,
        values,
        starts,
        starts * (kv_heads * positions),
        1,
        max_len_k,
        0.0,
        False,
        False,
        scale=scaling,
        seqused_k=lengths.to(torch.int32),
    )[0]
    return out


def _packed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    packed: PackedRows,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """``[T, heads, dim]`` queries over ``[K, kv_heads, dim]`` keys; ``[1, T, heads, dim]``
    out. Each sequence's last query sees all its keys (the causal mask is aligned at the
    end, the cached prefix before the new tokens)."""
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    if packed.flash:
        out = flash_varlen(
            query,
            keys,
            values,
            packed.cu_q,
            packed.max_q,
            scaling,
            cu_seqlens_k=packed.cu_k,
            max_len_k=packed.max_k,
        )
        return out.unsqueeze(0), None
    # Per sequence, with an explicit mask: new token j of a sequence starting at position p
    # sees positions 0..p+j.
    cu_q, cu_k = packed.cu_q.tolist(), packed.cu_k.tolist()
    parts = []
    for s, start in enumerate(packed.starts):
        q = query[cu_q[s] : cu_q[s + 1]].transpose(0, 1)
        k = keys[cu_k[s] : cu_k[s + 1]].transpose(0, 1)
        v = values[cu_k[s] : cu_k[s + 1]].transpose(0, 1)
        n_q, n_k = q.shape[1], k.shape[1]
        mask = torch.arange(n_k, device=q.device).view(1, n_k) <= (
            start + torch.arange(n_q, device=q.device).view(n_q, 1)
        )
        parts.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[0] != k.shape[0]
            ).transpose(0, 1)
        )
    return torch.cat(parts).unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
# Outside the engine the model builds SDPA masks as usual, so it stays a working HF model.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
