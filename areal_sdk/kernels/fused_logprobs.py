"""Fused Triton kernels for per-token logprobs and entropy of ``hidden @ W.T / temperature``.

Forward: one kernel computes, per row, the log-sum-exp, the label's logit and the entropy
by streaming over vocabulary tiles (matmul tile with float32 accumulation, then an online
softmax update). No logits are written to memory. To fill the GPU when T is small, the
vocabulary is also split across programs; the per-split partial statistics
(max, sum of exp, sum of exp * z, label logit) are merged in torch, O(T x splits).

Backward: per chunk of rows, a second kernel recomputes the logits tile by tile and writes
the gradient with respect to the logits directly (in the input dtype):

    dz = g_lp * (onehot(label) - p) - g_ent * p * (log p + H),   then / temperature

and cuBLAS turns that chunk into dhidden = dz @ W and dW += dz.T @ hidden. Peak extra
memory is one [chunk, V] tensor in the input dtype: ``chunk_size`` rows, or more up to
``BACKWARD_CHUNK_BYTES``.

Needs triton and CUDA tensors (or ``TRITON_INTERPRET=1`` with CPU tensors, float32 only,
for debugging). ``areal_sdk.logprobs`` is the entry point; it falls back to pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch parameters of one kernel."""

    block_t: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int


# From the H200 sweep of benchmarks/logprobs_memory.py (benchmarks/logprobs.md); the
# backward config is the one the full-size correctness check ran with.
FORWARD_CONFIG = TileConfig(block_t=128, block_v=128, block_h=64, num_warps=8, num_stages=3)
BACKWARD_CONFIG = TileConfig(block_t=64, block_v=128, block_h=64, num_warps=4, num_stages=3)
# Hopper (sm_90) and later: the dlogits kernel on 128 x 256 tiles took the head's forward +
# backward over 32k rows from 79.4 to 74.6 ms on an H100 (benchmarks/train_step_parts.py);
# its 144 KiB of shared memory per program is more than smaller GPUs have.
HOPPER_BACKWARD_CONFIG = TileConfig(block_t=128, block_v=256, block_h=64, num_warps=8, num_stages=3)
FP32_CONFIG = TileConfig(block_t=32, block_v=64, block_h=32, num_warps=4, num_stages=2)
# Aim for at least this many programs in the forward grid (a few per SM).
_TARGET_PROGRAMS = 512
# Backward chunks may grow past ``chunk_size`` rows up to a dz buffer of this size: each
# chunk passes the float32 dW accumulator through memory once more (1 GiB of traffic per
# chunk at a 152k vocabulary), so a few large chunks beat many small ones.
BACKWARD_CHUNK_BYTES = 2 << 30


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    H,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IEEE: tl.constexpr,
):
    """[BLOCK_T, BLOCK_V] float32 tile of (hidden @ W.T) * inv_temp."""
    # int64 offsets: V x H and chunk x V exceed 2**31 at LLM sizes.
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        h = tl.load(
            h_ptr + rows[:, None] * stride_h + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_w + ks[:, None],
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        # float32 inputs: exact products, not TF32 (which would differ from torch's matmul).
        if IEEE:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            acc = tl.dot(h, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(h, w, acc)
    return acc * inv_temp


@triton.jit
def _forward_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    m_out,
    s_out,
    zs_out,
    label_out,
    T,
    V,
    H,
    stride_h,
    stride_w,
    cols_per_split,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    col_start = split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, V)

    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zs = tl.zeros((BLOCK_T,), dtype=tl.float32)
    label_z = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # Loop bounds are kernel arguments (not tensors) so the interpreter can run this too;
    # the last split's tiles past V are fully masked.
    for offset in range(0, cols_per_split, BLOCK_V):
        cols = col_start + offset + tl.arange(0, BLOCK_V)
        col_mask = cols < col_end
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            H,
            stride_h,
            stride_w,
            inv_temp,
            BLOCK_T,
            BLOCK_V,
            BLOCK_H,
            IEEE,
        )
        z_valid = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_valid, axis=1))
        scale = tl.exp(m - m_new)
        p = tl.exp(z_valid - m_new[:, None])
        s = s * scale + tl.sum(p, axis=1)
        zs = zs * scale + tl.sum(tl.where(col_mask[None, :], p * z, 0.0), axis=1)
        m = m_new
        hit = cols[None, :] == labels[:, None]
        label_z += tl.sum(tl.where(hit, z, 0.0), axis=1)

    out = split * T + rows
    tl.store(m_out + out, m, mask=row_mask)
    tl.store(s_out + out, s, mask=row_mask)
    tl.store(zs_out + out, zs, mask=row_mask)
    tl.store(label_out + out, label_z, mask=row_mask)


@triton.jit
def _grad_logits_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    g_lp_ptr,
    g_ent_ptr,
    dz_ptr,
    T,
    V,
    H,
    stride_h,
    stride_w,
    stride_dz,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IEEE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < T
    col_mask = cols < V
    z = _logits_tile(
        h_ptr,
        w_ptr,
        rows,
        cols,
        row_mask,
        col_mask,
        H,
        stride_h,
        stride_w,
        inv_temp,
        BLOCK_T,
        BLOCK_V,
        BLOCK_H,
        IEEE,
    )
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_mask, other=0.0)
    log_p = z - lse[:, None]
    p = tl.exp(log_p)
    hit = cols[None, :] == labels[:, None]
    dz = tl.where(hit, g_lp[:, None], 0.0) - g_lp[:, None] * p
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_mask, other=0.0)
        dz -= g_ent[:, None] * p * (log_p + ent[:, None])
    dz = dz * inv_temp
    tl.store(
        dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :],
        dz.to(dz_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _backward_config(device: torch.device) -> TileConfig:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return HOPPER_BACKWARD_CONFIG
    return BACKWARD_CONFIG


def _config(dtype: torch.dtype, default: TileConfig) -> TileConfig:
    # float32 tiles need twice the shared memory per element; keep them small.
    return FP32_CONFIG if dtype == torch.float32 else default


def _forward_stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, inv_temp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, label logit, entropy) per row, float32 [T] each."""
    n, h_dim = hidden.shape
    vocab = weight.shape[0]
    cfg = _config(hidden.dtype, FORWARD_CONFIG)
    row_blocks = triton.cdiv(n, cfg.block_t)
    # Split the vocabulary so that row blocks x splits fills the GPU; each split a whole
    # number of tiles, none empty.
    n_tiles = triton.cdiv(vocab, cfg.block_v)
    splits = max(1, min(n_tiles, triton.cdiv(_TARGET_PROGRAMS, row_blocks)))
    cols_per_split = triton.cdiv(n_tiles, splits) * cfg.block_v
    splits = triton.cdiv(vocab, cols_per_split)
    stats = torch.empty((4, splits, n), dtype=torch.float32, device=hidden.device)
    _forward_kernel[(row_blocks, splits)](
        hidden,
        weight,
        labels,
        stats[0],
        stats[1],
        stats[2],
        stats[3],
        n,
        vocab,
        h_dim,
        hidden.stride(0),
        weight.stride(0),
        cols_per_split,
        inv_temp,
        BLOCK_T=cfg.block_t,
        BLOCK_V=cfg.block_v,
        BLOCK_H=cfg.block_h,
        IEEE=hidden.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    m, s, zs, label_z = stats
    m_all = m.max(dim=0).values
    scale = torch.exp(m - m_all)
    s_all = (s * scale).sum(0)
    lse = m_all + torch.log(s_all)
    entropy = lse - (zs * scale).sum(0) / s_all
    return lse, label_z.sum(0), entropy


def _grad_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    inv_temp: float,
) -> torch.Tensor:
    """d(loss)/d(logits) for one chunk of rows, [c, V] in the input dtype."""
    n, h_dim = h.shape
    vocab = weight.shape[0]
    cfg = _config(h.dtype, _backward_config(h.device))
    dz = torch.empty((n, vocab), dtype=h.dtype, device=h.device)
    grid = (triton.cdiv(n, cfg.block_t), triton.cdiv(vocab, cfg.block_v))
    _grad_logits_kernel[grid](
        h,
        weight,
        labels,
        lse,
        entropy,
        g_lp,
        g_ent if g_ent is not None else g_lp,
        dz,
        n,
        vocab,
        h_dim,
        h.stride(0),
        weight.stride(0),
        dz.stride(0),
        inv_temp,
        BLOCK_T=cfg.block_t,
        BLOCK_V=cfg.block_v,
        BLOCK_H=cfg.block_h,
        IEEE=h.dtype == torch.float32,
        WITH_ENTROPY=g_ent is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return dz


# bf16 x bf16 -> float32 products in cuBLAS (torch >= 2.9 on CUDA): the running float32 dW
# is updated in the GEMM's epilogue instead of a bf16 product plus a separate add per chunk.
_MIXED_ADDMM = hasattr(torch.ops.aten.addmm, "dtype_out")


def _accumulate_grad_w(
    grad_w: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """``grad_w + dz.T @ h`` in float32 (``grad_w`` None: the first chunk)."""
    if dz.dtype == torch.float32 or not (_MIXED_ADDMM and dz.is_cuda):
        update = (dz.T @ h).float()
        return update if grad_w is None else grad_w.add_(update)
    if grad_w is None:
        return torch.mm(dz.T, h, out_dtype=torch.float32)
    return torch.addmm(grad_w, dz.T, h, out_dtype=torch.float32, out=grad_w)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        labels = labels.contiguous()
        inv_temp = 1.0 / temperature
        lse, label_z, entropy = _forward_stats(hidden, weight, labels, inv_temp)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.set_materialize_grads(False)
        ctx.inv_temp = inv_temp
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        if not with_entropy:
            entropy = entropy.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return label_z - lse, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        # Unused outputs arrive as None (no materialised zeros): no entropy term then.
        g_lp = (
            grad_logprobs.float().contiguous()
            if grad_logprobs is not None
            else torch.zeros(n, dtype=torch.float32, device=hidden.device)
        )
        g_ent = (
            grad_entropy.float().contiguous()
            if ctx.with_entropy and grad_entropy is not None
            else None
        )
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None  # float32 running sum over chunks, as in the torch path
        per_row = weight.shape[0] * hidden.element_size()
        chunk = max(ctx.chunk_size, BACKWARD_CHUNK_BYTES // per_row // 128 * 128)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            h = hidden[rows]
            dz = _grad_logits(
                h,
                weight,
                labels[rows],
                lse[rows],
                entropy[rows],
                g_lp[rows],
                g_ent[rows] if g_ent is not None else None,
                ctx.inv_temp,
            )
            if need_h:
                torch.mm(dz, weight, out=grad_h[rows])
            if need_w:
                grad_w = _accumulate_grad_w(grad_w, dz, h)
            del dz
        if need_w and grad_w is None:  # no rows
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def fused_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [T] and entropy [T] (empty when ``with_entropy`` is False), float32.

    Same contract as ``areal_sdk.logprobs.token_logprobs_and_entropy`` minus its checks.
    """
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return _FusedLogprobs.apply(
        hidden, weight, labels.to(torch.long), float(temperature), int(chunk_size), with_entropy
    )
