"""Per-token logprobs and entropy without materialising [T, V] float32 logits.

The naive ``log_softmax(hidden @ W.T / temperature)`` over a 150k vocabulary holds a float32
[T, V] tensor (and autograd keeps it, plus the softmax, for backward): 16k tokens x 152k
vocabulary is 9.7 GB per copy. Here the logits exist one chunk of rows at a time:

- ``backend="torch"``: an autograd Function that, per chunk of ``chunk_size`` rows, computes
  the logits, keeps only the row's log-sum-exp (and entropy), and throws the chunk away;
  backward recomputes each chunk's logits and turns them straight into the gradients of
  ``hidden`` and ``W``. Peak extra memory is O(chunk_size x V), independent of T.
- ``backend="triton"``: ``areal_sdk.kernels.fused_logprobs``; forward is one fused kernel
  (matmul tiles + online log-sum-exp, no logits in memory at all), backward a fused
  matmul + gradient kernel per chunk.
- ``backend="stored"``: ``areal_sdk.kernels.stored_softmax``; cuBLAS logits turned into
  probabilities in place and kept for backward (``T x V`` elements more memory, one
  vocabulary-sized product less).
- ``backend="auto"``: triton when it is installed and the tensors are on CUDA, else torch.
  Give it bf16 inputs: in float32 the kernel is several times slower than cuBLAS
  (benchmarks/README.md, "Training throughput").

The softmax side is float32 in both. The torch path rounds the logits to the input dtype
first, as the model's own lm_head would; the Triton kernel keeps its float32 accumulators.

``compute_dtype`` runs the products in another dtype than the weight's (bf16 products from
float32 master weights, as autocast does) while the weight's gradient comes back in its own
dtype, accumulated in float32: no bf16 copy of the weight is kept for backward, and the
gradient makes no bf16 round trip (for SmolLM2's 49k x 576 head, 0.2 GiB less at the start
of every backward).

>>> h, w = torch.randn(5, 8), torch.randn(11, 8)
>>> lp, ent = token_logprobs_and_entropy(h, w, torch.tensor([0, 3, 10, 2, 2]), chunk_size=2)
>>> torch.allclose(lp, torch.log_softmax(h @ w.T, -1)[torch.arange(5), [0, 3, 10, 2, 2]])
True
"""

from __future__ import annotations

from typing import Any

import torch

Backend = str  # "auto" | "torch" | "triton" | "stored"


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c, V] float32 logits / temperature for one chunk of rows.

    The matmul runs in the input dtype (a bf16 model's lm_head gives bf16 logits, exactly
    what the naive computation and the HF model see), then the softmax side is float32.
    """
    logits = (h @ weight.T).float()
    if temperature != 1.0:
        logits /= temperature
    return logits


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward one chunk of rows at a time; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        compute_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        product_weight = weight.to(compute_dtype)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            logits = _chunk_logits(hidden[rows], product_weight, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[rows] = chunk_lse
            logprobs[rows] = logits.gather(1, labels[rows, None]).squeeze(1) - chunk_lse
            if with_entropy:
                # H = lse - sum_v p_v z_v, with p = softmax(z); computed in place on the chunk.
                weighted = logits.mul_(torch.exp(logits - chunk_lse[:, None])).sum(-1)
                entropy[rows] = chunk_lse - weighted
            del logits
        del product_weight  # cast again in backward rather than held until then
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, master, labels, lse, entropy = ctx.saved_tensors
        weight = master.to(hidden.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulate dW over chunks in float32; a bf16 running sum would lose the small terms.
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for start in range(0, n, ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, n))
            h = hidden[rows]
            # Two float32 [c, V] buffers, everything in place:
            #   d logprob / dz = onehot(label) - p
            #   d entropy / dz = -p * (log p + H)
            log_p = _chunk_logits(h, weight, ctx.temperature).sub_(lse[rows, None])
            p = log_p.exp()
            g_lp = grad_logprobs[rows, None] if grad_logprobs is not None else None
            if use_entropy:
                grad_z = log_p.add_(entropy[rows, None]).mul_(p).mul_(-grad_entropy[rows, None])
                if g_lp is not None:
                    grad_z.sub_(p.mul_(g_lp))
                del p
            elif g_lp is not None:
                grad_z = p.mul_(-g_lp)
                del log_p
            else:
                grad_z = p.zero_()
            if g_lp is not None:
                grad_z.scatter_add_(1, labels[rows, None], g_lp)
            if ctx.temperature != 1.0:
                grad_z /= ctx.temperature
            # The two gradient matmuls run in the input dtype, like autograd's would.
            grad_z = grad_z.to(hidden.dtype)
            if need_h:
                grad_h[rows] = grad_z @ weight
            if need_w:
                grad_w.add_(grad_z.T @ h)
            del grad_z
        if grad_w is not None:
            grad_w = grad_w.to(master.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _triton_usable(hidden: torch.Tensor) -> bool:
    if not hidden.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    backend: Backend = "auto",
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ W.T / temperature)[t, labels[t]]`` and the entropy per row.

    ``hidden`` [T, H] (final hidden states, any float dtype), ``lm_head_weight`` [V, H],
    ``labels`` [T] int. Returns float32 logprobs [T] and entropy [T] (or None), both
    differentiable with respect to ``hidden`` and ``lm_head_weight``. The products run in
    ``compute_dtype`` (default: the weight's); the weight's gradient has its own dtype.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and lm_head_weight [V, H]; got {tuple(hidden.shape)} and "
            f"{tuple(lm_head_weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if backend not in ("auto", "torch", "triton", "stored"):
        raise ValueError(f"unknown backend {backend!r}; use auto, torch, triton or stored")
    compute_dtype = compute_dtype or lm_head_weight.dtype
    if hidden.dtype != compute_dtype:
        hidden = hidden.to(compute_dtype)
    labels = labels.to(device=hidden.device, dtype=torch.long)
    vocab = lm_head_weight.shape[0]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        raise ValueError(
            f"labels must lie in [0, {vocab}); got {int(labels.min())}..{int(labels.max())}"
        )
    if backend == "triton" and not _triton_usable(hidden):
        raise ValueError("backend='triton' needs the triton package and CUDA tensors")
    if backend == "stored":
        from areal_sdk.kernels.stored_softmax import stored_softmax_logprobs

        logprobs, entropy = stored_softmax_logprobs(
            hidden,
            lm_head_weight,
            labels,
            temperature=temperature,
            with_entropy=with_entropy,
            compute_dtype=compute_dtype,
        )
    elif backend == "triton" or (backend == "auto" and _triton_usable(hidden)):
        from areal_sdk.kernels.fused_logprobs import fused_logprobs_and_entropy

        logprobs, entropy = fused_logprobs_and_entropy(
            hidden,
            lm_head_weight.to(compute_dtype),
            labels,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
    else:
        logprobs, entropy = _ChunkedLogprobs.apply(
            hidden,
            lm_head_weight,
            labels,
            float(temperature),
            int(chunk_size),
            with_entropy,
            compute_dtype,
        )
    return logprobs, (entropy if with_entropy else None)
