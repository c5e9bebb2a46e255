"""Attention over a packed row, one causal block per sequence, registered with transformers.

A packed micro-batch is one row of many sequences. Through SDPA it needs a block-diagonal
mask, and a masked kernel pays for the whole row (N^2 for N tokens) where the sequences need
only the sum of their own squares. ``varlen`` takes the sequence boundaries (``cu_seqlens``)
instead of a mask:

- on CUDA in fp16/bf16, torch's flash-attention ``varlen_attn`` (``torch.nn.attention.
  varlen``), the kernel flash-attention's ``cu_seqlens`` API exposes, forward and backward;
- there too, when the sequences are of similar length (``padded_layout``), cuDNN's fused
  attention over them as a right-padded batch: 1.56x flash's speed forward + backward on an
  H100 at head_dim 64, worth some padding (cuDNN's own ragged mode, tried too, was 60x slower
  with wrong gradients in torch 2.11);
- elsewhere (CPU, float32), causal SDPA per sequence: no mask, no padding.

Register once with ``register()`` and load the model with ``attn_implementation="varlen"``;
transformers then builds no mask (the name has no mask function) and passes the
``cu_seq_lens_q`` / ``max_length_q`` keywords of the model's forward to every layer.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

NAME = "varlen"


def _load_flash_varlen() -> tuple[Any, frozenset[str]] | None:
    """torch's ``varlen_attn`` and its keyword names, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# Looked up once at import: under torch.compile the attention call then reads a constant
# instead of tracing an import and ``inspect`` (each a graph break).
_FLASH_VARLEN = _load_flash_varlen()


def flash_available(device: torch.device) -> bool:
    """Whether ``varlen`` runs the flash kernel on ``device`` (else per-sequence SDPA)."""
    return device.type == "cuda" and _FLASH_VARLEN is not None


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float | None,
    *,
    cu_seqlens_k: torch.Tensor | None = None,
    max_len_k: int | None = None,
) -> torch.Tensor:
    """``[N, H, D]`` inputs through the flash varlen kernel, causal, GQA native.

    With ``cu_seqlens_k`` the keys of a sequence may be longer than its queries (a cached
    prefix, then the new tokens): the causal mask aligns the last query with the last key,
    as flash-attention's does."""
    assert _FLASH_VARLEN is not None
    varlen_attn, params = _FLASH_VARLEN
    kwargs: dict[str, Any] = {"scale": scale}
    # The causal switch moved between torch releases: ``is_causal`` first, then a window.
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    cu_k = cu if cu_seqlens_k is None else cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    return varlen_attn(
        q, k, v, cu, cu_k, max_len, max_len if max_len_k is None else max_len_k, **kwargs
    )


# The padded-batch path may cost up to this many times the sum of squares of the sequences
# and still beat flash varlen: cuDNN's fused attention ran forward + backward 1.55x faster than
# flash varlen on an H100 (head_dim 64, 16 x 2,048 tokens; benchmarks/train_step_parts.py).
PADDED_COST_LIMIT = 1.4


def cudnn_available(device: torch.device) -> bool:
    """Whether cuDNN's fused attention can serve ``padded_cudnn`` on ``device``."""
    return (
        device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
    )


def padded_layout(
    cu_seqlens: torch.Tensor, lengths: list[int], kernel: str
) -> tuple[torch.Tensor | None, int, int] | None:
    """Where the packed tokens go in a right-padded ``[len(lengths), max(lengths)]`` batch
    for ``padded_cudnn``, or None to stay with flash varlen.

    ``kernel``: ``"cudnn"`` always pads, ``"flash"`` never, ``"auto"`` pads when the padded
    batch's attention costs at most ``PADDED_COST_LIMIT`` times the sequences' own. The index
    is None when every sequence has the longest length (the row is the batch already).
    """
    longest, batch = max(lengths), len(lengths)
    if kernel == "flash" or not cudnn_available(cu_seqlens.device):
        return None
    if kernel == "auto" and batch * longest**2 > PADDED_COST_LIMIT * sum(n * n for n in lengths):
        return None
    if batch * longest == int(sum(lengths)):
        return None, batch, longest
    device, n = cu_seqlens.device, sum(lengths)
    sizes = torch.tensor(lengths, device=device)
    seq = torch.repeat_interleave(torch.arange(batch, device=device), sizes, output_size=n)
    starts = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    index = torch.arange(n, device=device) - starts[seq] + seq * longest
    return index, batch, longest


def padded_cudnn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor | None,
    batch: int,
    length: int,
    scale: float | None,
) -> torch.Tensor:
    """``[N, H, D]`` packed inputs through cuDNN's fused causal attention as a right-padded
    ``[batch, length]`` batch; ``[N, H, D]`` out.

    Causal attention never looks past a query, so a sequence's own tokens never see its
    padding, and the padded rows' outputs are dropped (their gradient is zero)."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if index is not None:
            t = t.new_zeros(batch * length, *t.shape[1:]).index_copy(0, index, t)
        return t.view(batch, length, *t.shape[1:]).transpose(1, 2)

    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        pad(q),
        pad(k),
        pad(v),
        None,
        torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        0.0,
        True,
        False,
        scale=scale,
    )[0]
    out = out.transpose(1, 2).reshape(batch * length, *q.shape[1:])
    return out if index is None else out.index_select(0, index)


@dataclass(frozen=True)
class PrefixKeys:
    """Which keys each sequence of a packed row attends over when some continue a shared
    prefix held once in the row (``packing``'s ``share_prefixes``): its prefix's, then its own.

    ``index`` gathers them from the row's keys, one run per sequence, bounded by
    ``cu_seqlens_k``; causal attention aligned at the end (a sequence's last query sees every
    one of its keys) masks the rest, as flash-attention aligns queries shorter than keys."""

    index: torch.Tensor  # [K] int64, on the row's device
    cu_seqlens_k: torch.Tensor  # [S+1] int32, on the row's device
    max_len_k: int


def prefix_keys(cu_seqlens: torch.Tensor, parents: torch.Tensor) -> PrefixKeys:
    """The ``PrefixKeys`` of a row with sequence boundaries ``cu_seqlens`` whose sequence
    ``i`` continues sequence ``parents[i]`` (-1: none)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    runs: list[torch.Tensor] = []
    bounds_k = [0]
    for i, parent in enumerate(parents.tolist()):
        own = bounds[i + 1] - bounds[i]
        if parent >= 0:
            runs.append(torch.arange(bounds[parent], bounds[parent + 1]))
            own += bounds[parent + 1] - bounds[parent]
        runs.append(torch.arange(bounds[i], bounds[i + 1]))
        bounds_k.append(bounds_k[-1] + own)
    device = cu_seqlens.device
    index = torch.cat(runs).to(device)
    lengths = [b - a for a, b in itertools.pairwise(bounds_k)]
    return PrefixKeys(
        index=index,
        cu_seqlens_k=torch.tensor(bounds_k, dtype=torch.int32, device=device),
        max_len_k=max(lengths),
    )


def _per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    scale: float | None,
    bounds_k: list[int] | None = None,
) -> torch.Tensor:
    """``[1, H, N, D]`` inputs, causal SDPA on each sequence's slice; ``[N, H, D]`` out.

    With ``bounds_k`` (``PrefixKeys.cu_seqlens_k``, keys already gathered) a sequence's keys may be more
    than its queries: causal aligned at the end."""
    gqa = query.shape[1] != key.shape[1]
    bounds_k = bounds if bounds_k is None else bounds_k
    parts = []
    for (a, b), (ka, kb) in zip(
        itertools.pairwise(bounds), itertools.pairwise(bounds_k), strict=True
    ):
        q_len, k_len = b - a, kb - ka
        mask = None
        if k_len != q_len:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(
                k_len - q_len
            )
        parts.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, ka:kb],
                value[:, :, ka:kb],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return torch.cat(parts, dim=2)[0].transpose(0, 1)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[B, H, S, D]`` in, ``[B, S, H, D]`` out.

    Needs ``cu_seq_lens_q`` (and ``max_length_q``) for a packed row (batch 1); without
    them the row is one sequence. With ``varlen_padded`` (from ``padded_layout``) the row
    runs through cuDNN as a padded batch instead of flash varlen; with
    ``varlen_prefix_index``, ``cu_seq_lens_k`` and ``max_length_k`` (a ``PrefixKeys``)
    sequences attend over their shared prefix's keys too.
    """
    if dropout:
        raise ValueError("varlen attention does not apply dropout")
    if attention_mask is not None:
        raise ValueError("varlen attention takes sequence boundaries, not a mask")
    batch, _, n, _ = query.shape
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    # From ``PrefixKeys``, as plain keywords: tensors and ints are what torch.compile traces
    # without a recompile per micro-batch.
    prefix_index: torch.Tensor | None = kwargs.get("varlen_prefix_index")
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=True,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    if batch != 1:
        raise ValueError(f"varlen attention takes one packed row, got a batch of {batch}")
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):
        # The rotary embedding promotes q and k to the float32 residual stream's dtype;
        # autocast would cast them back for SDPA, but not for a custom kernel.
        dtype = torch.get_autocast_dtype(query.device.type)
    if flash_available(query.device) and dtype in (torch.float16, torch.bfloat16):
        max_len = kwargs.get("max_length_q")
        if max_len is None:
            max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
        padded = kwargs.get("varlen_padded")
        if prefix_index is not None:
            k, v = k.index_select(0, prefix_index), v.index_select(0, prefix_index)
            out = flash_varlen(
                q,
                k,
                v,
                cu_seqlens,
                int(max_len),
                scaling,
                cu_seqlens_k=kwargs["cu_seq_lens_k"],
                max_len_k=int(kwargs["max_length_k"]),
            )
        elif padded is not None:
            out = padded_cudnn(q, k, v, *padded, scaling)
        else:
            out = flash_varlen(q, k, v, cu_seqlens, int(max_len), scaling)
    else:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != n:
            raise ValueError(f"cu_seq_lens_q {bounds} does not cover the row of {n} tokens")
        bounds_k = None
        if prefix_index is not None:
            key = key.index_select(2, prefix_index)
            value = value.index_select(2, prefix_index)
            bounds_k = [int(b) for b in kwargs["cu_seq_lens_k"].tolist()]
        out = _per_sequence(query, key, value, bounds, scaling, bounds_k)
    return out.unsqueeze(0), None


@cache
def register() -> str:
    """Register ``varlen`` with transformers' attention interface; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    return NAME
