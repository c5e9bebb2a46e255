"""Batched sampling with per-row parameters, and the logprobs the trainer will recompute.

Logprobs. For a row with temperature ``T > 0`` the returned logprob of the sampled token is
``log_softmax(logits / T)[token]``; for greedy rows (``T == 0``) it is
``log_softmax(logits)[token]``. That is the distribution a trainer computes from the same
logits, so behaviour and proximal logprobs agree.

Truncation. top_k, top_p and min_p only choose which tokens may be *sampled*; the returned
logprob is taken from the untruncated, temperature-scaled distribution above (SGLang does the
same). When truncation is active, the exact probability the sampler used is that value
renormalised over the kept set: ``logprob - logsumexp(kept logprobs)``, always >= the
returned value. Leave top_p=1, top_k=-1, min_p=0 for RL when the two must coincide.

Randomness. Each row samples by Gumbel-max with noise from a counter-based hash of
``(seed, step)``, where ``step`` is the number of tokens the request has already produced.
A seeded request therefore draws the same tokens whatever else shares its batch, and after a
retraction or a re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, as tensors on the logits' device."""

    temperature: torch.Tensor  # [R] float; 0 means greedy
    top_k: torch.Tensor  # [R] long; -1 disables
    top_p: torch.Tensor  # [R] float
    min_p: torch.Tensor  # [R] float
    seed: torch.Tensor  # [R] long, < 2**31
    step: torch.Tensor  # [R] long

    @classmethod
    def build(
        cls,
        rows: list[tuple[float, int, float, float, int, int]],
        device: torch.device,
    ) -> SamplingBatch:
        """``rows`` are ``(temperature, top_k, top_p, min_p, seed, step)`` tuples."""
        t, k, p, mp, s, st = zip(*rows, strict=True)
        return cls(
            temperature=torch.tensor(t, dtype=torch.float32, device=device),
            top_k=torch.tensor(k, dtype=torch.long, device=device),
            top_p=torch.tensor(p, dtype=torch.float32, device=device),
            min_p=torch.tensor(mp, dtype=torch.float32, device=device),
            seed=torch.tensor(s, dtype=torch.long, device=device),
            step=torch.tensor(st, dtype=torch.long, device=device),
        )


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors; multipliers < 2**31 keep products < 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` standard Gumbel noise that depends only on ``(seed, step, token)``."""
    head = _hash32(_hash32(seed & _M32) ^ (step & _M32))
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    x = _hash32(head.view(-1, 1) ^ ((ids * 0x9E3779B1) & _M32).view(1, -1))
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of float32 ``logits [R, V]``; return (tokens, logprobs)."""
    greedy = params.temperature <= 0
    scale = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    logprobs = torch.log_softmax(logits / scale.view(-1, 1), dim=-1)
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens.view(-1, 1)).view(-1)
    scores = _truncate(logprobs, params)
    noisy = scores + gumbel_noise(params.seed, params.step, logits.shape[-1])
    tokens = torch.where(greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))
    return tokens, logprobs.gather(1, tokens.view(-1, 1)).view(-1)


def _truncate(logprobs: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Set the logprobs of tokens that top_k / top_p / min_p exclude to -inf."""
    use_k = params.top_k > 0
    use_p = params.top_p < 1.0
    use_min = params.min_p > 0
    if not bool((use_k | use_p | use_min).any()):
        return logprobs
    vocab = logprobs.shape[-1]
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logprobs.device).view(1, -1)
    drop = torch.zeros_like(sorted_lp, dtype=torch.bool)
    k = torch.where(use_k, params.top_k, torch.full_like(params.top_k, vocab))
    drop |= rank >= k.view(-1, 1)
    probs = sorted_lp.exp()
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before > params.top_p.view(-1, 1)
    drop |= probs < (params.min_p * probs[:, :1].squeeze(1)).view(-1, 1)
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return logprobs.masked_fill(mask, float("-inf"))
