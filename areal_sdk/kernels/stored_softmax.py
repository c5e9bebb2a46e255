"""Per-token logprobs and entropy that keep the softmax for backward instead of recomputing it.

The fused head (``fused_logprobs``) writes no logits and recomputes them in backward: three
vocabulary-sized products for a two-product gradient. This one trades memory for that fourth
product. Forward computes the logits chunk by chunk with cuBLAS (float32 out, like the fused
kernel's accumulators) and turns each chunk into probabilities in one pass (log-sum-exp, the
label's logit, the entropy), kept in one ``[T, V]`` buffer of the compute dtype. Backward
reads them:

    d logprob / d z = onehot(label) - p, so, with g the logprob's gradient,
    dhidden = g * (W[label] - p @ W)            dW = scatter(label, g * h) - p.T @ (g * h)

two products over ``p`` and no ``[T, V]`` gradient. With an entropy gradient the gradient of
the logits is formed in place over ``p`` (``- g_ent * p * (log p + H)`` joins the term above)
and the two products read it.

The buffer costs ``T x V`` elements of the compute dtype (10 GB at 32k tokens and a 152k
vocabulary in bf16), held from forward to backward; backward consumes it, so a graph through
this function runs backward once.

>>> h, w = torch.randn(5, 8), torch.randn(11, 8)
>>> lp, ent = stored_softmax_logprobs(h, w, torch.tensor([0, 3, 10, 2, 2]))
>>> torch.allclose(lp, torch.log_softmax(h @ w.T, -1)[torch.arange(5), [0, 3, 10, 2, 2]], atol=1e-6)
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Rows per forward chunk: enough to keep the products large; a chunk's float32 logits are
# 2.5 GB at 4,096 rows and a 152k vocabulary.
CHUNK_ROWS = 4096


def _softmax_into(
    logits: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor, inv_temp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write softmax(``logits`` * inv_temp) into ``probs`` [c, V] (its dtype); return (lse,
    the label's scaled logit, entropy), float32 [c] each."""
    scaled = logits.float() * inv_temp
    top = scaled.amax(-1, keepdim=True)
    exp = torch.exp(scaled - top)
    total = exp.sum(-1, keepdim=True)
    p = exp / total
    lse = (top + total.log()).squeeze(1)
    entropy = lse - (p * scaled).sum(-1)
    label_z = scaled.gather(1, labels[:, None]).squeeze(1)
    probs.copy_(p)
    return lse, label_z, entropy


@functools.cache
def _compiled_softmax() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    # One fused Triton pass on CUDA; the eager ops make five passes over a chunk.
    return torch.compile(_softmax_into, dynamic=True)


def _grad_logits_in_place(
    probs: torch.Tensor,
    labels: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    inv_temp: float,
) -> None:
    """Overwrite ``probs`` [c, V] with d(loss)/d(pre-temperature logits)."""
    p = probs.float()
    grad = p * (-g_lp[:, None]) - g_ent[:, None] * p * (
        torch.log(p.clamp_min(1e-30)) + entropy[:, None]
    )
    grad.scatter_add_(1, labels[:, None], g_lp[:, None])
    probs.copy_(grad * inv_temp)


@functools.cache
def _compiled_grad_logits() -> Callable[..., None]:
    return torch.compile(_grad_logits_in_place, dynamic=True)


def _mm_float(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in float32 (cuBLAS writes float32 from bf16)."""
    if a.dtype != torch.float32 and a.is_cuda and hasattr(torch.ops.aten.mm, "dtype_out"):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


class _StoredSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        compute_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        product_weight = weight.to(compute_dtype)
        h = hidden.to(compute_dtype)
        n, vocab = h.shape[0], weight.shape[0]
        inv_temp = 1.0 / temperature
        probs = torch.empty((n, vocab), dtype=compute_dtype, device=h.device)
        stats = torch.empty((3, n), dtype=torch.float32, device=h.device)
        softmax = _compiled_softmax() if h.is_cuda else _softmax_into
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, n))
            # float32 logits, as the fused kernel's accumulators: only p is rounded.
            logits = _mm_float(h[rows], product_weight.T)
            lse, label_z, entropy = softmax(logits, probs[rows], labels[rows], inv_temp)
            del logits
            stats[0, rows], stats[1, rows], stats[2, rows] = lse, label_z, entropy
        lse, label_z, entropy = stats
        ctx.save_for_backward(h, weight, labels, probs, entropy)
        ctx.set_materialize_grads(False)
        ctx.inv_temp = inv_temp
        ctx.with_entropy = with_entropy
        ctx.compute_dtype = compute_dtype
        ctx.hidden_dtype = hidden.dtype
        if not with_entropy:
            entropy = entropy.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return label_z - lse, entropy.clone()

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        h, master, labels, probs, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        weight = master.to(ctx.compute_dtype)
        n = h.shape[0]
        g_lp = (
            grad_logprobs.float()
            if grad_logprobs is not None
            else torch.zeros(n, dtype=torch.float32, device=h.device)
        )
        grad_h = grad_w = None
        if ctx.with_entropy and grad_entropy is not None:
            # The logits' gradient, in place over the kept probabilities.
            fill = _compiled_grad_logits() if h.is_cuda else _grad_logits_in_place
            for start in range(0, n, CHUNK_ROWS):
                rows = slice(start, min(start + CHUNK_ROWS, n))
                fill(
                    probs[rows],
                    labels[rows],
                    entropy[rows],
                    g_lp[rows],
                    grad_entropy[rows].float(),
                    ctx.inv_temp,
                )
            if need_h:
                grad_h = (probs @ weight).to(ctx.hidden_dtype)
            if need_w:
                grad_w = _mm_float(probs.T, h)
        else:
            g = g_lp * ctx.inv_temp
            if need_h:
                expected = _mm_float(probs, weight)
                grad_h = (g[:, None] * (weight[labels].float() - expected)).to(ctx.hidden_dtype)
            if need_w:
                g_h = (g[:, None] * h.float()).to(h.dtype)
                grad_w = _mm_float(probs.T, g_h).neg_()
                grad_w.index_add_(0, labels, g_h.float())
        if grad_w is not None:
            grad_w = grad_w.to(master.dtype)
        return grad_h, grad_w, None, None, None, None


def stored_softmax_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [T] and entropy [T] (empty when ``with_entropy`` is False), float32.

    Same contract as ``areal_sdk.logprobs.token_logprobs_and_entropy`` minus its checks."""
    return _StoredSoftmax.apply(
        hidden,
        weight,
        labels.to(torch.long),
        float(temperature),
        with_entropy,
        compute_dtype or weight.dtype,
    )
