"""Batched sampling with per-row parameters, and the logprobs the trainer will recompute.

Logprobs. For a row with temperature ``T > 0`` the returned logprob of the sampled token is
``log_softmax(logits / T)[token]``; for greedy rows (``T == 0``) it is
``log_softmax(logits)[token]``. That is the distribution a trainer computes from the same
logits, so behaviour and proximal logprobs agree.

Top logprobs. Asked for (``top_logprobs_num`` k > 0 in some row), the k largest entries of
the same distribution come back per row, best first; rows that asked for fewer keep a prefix.
Nothing extra is computed when no row asks.

Truncation. top_k, top_p and min_p only choose which tokens may be *sampled*; the returned
logprob is taken from the untruncated, temperature-scaled distribution above (SGLang does the
same). When truncation is active, the exact probability the sampler used is that value
renormalised over the kept set: ``logprob - logsumexp(kept logprobs)``, always >= the
returned value. Leave top_p=1, top_k=-1, min_p=0 for RL when the two must coincide.

Randomness. Each row samples by Gumbel-max. A seeded row's noise comes from a counter-based
hash of ``(seed, step)``, where ``step`` is the number of tokens the request has already
produced, so a seeded request draws the same tokens whatever else shares its batch, and after
a retraction or a re-prefill. Unseeded rows use the device RNG (one fast kernel).
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
    seeded: torch.Tensor  # [R] bool
    # Host-side summaries, so the common cases need no device->host sync.
    any_seeded: bool
    all_seeded: bool
    all_greedy: bool
    any_truncation: bool
    # The largest top_logprobs_num of any row; 0: none asked.
    top_logprobs: int = 0

    @classmethod
    def build(
        cls,
        rows: list[tuple[float, int, float, float, int | None, int]],
        device: torch.device,
        top_logprobs: int = 0,
    ) -> SamplingBatch:
        """``rows`` are ``(temperature, top_k, top_p, min_p, seed or None, step)`` tuples;
        ``top_logprobs`` is the largest number of top logprobs any row wants."""
        t, k, p, mp, raw_seeds, st = zip(*rows, strict=True)
        flags = [x is not None for x in raw_seeds]
        s = [x & 0x7FFFFFFF if x is not None else 0 for x in raw_seeds]
        return cls(
            temperature=torch.tensor(t, dtype=torch.float32, device=device),
            top_k=torch.tensor(k, dtype=torch.long, device=device),
            top_p=torch.tensor(p, dtype=torch.float32, device=device),
            min_p=torch.tensor(mp, dtype=torch.float32, device=device),
            seed=torch.tensor(s, dtype=torch.long, device=device),
            step=torch.tensor(st, dtype=torch.long, device=device),
            seeded=torch.tensor(flags, dtype=torch.bool, device=device),
            any_seeded=any(flags),
            all_seeded=all(flags),
            all_greedy=all(x <= 0 for x in t),
            any_truncation=any(kk > 0 for kk in k)
            or any(x < 1.0 for x in p)
            or any(x > 0 for x in mp),
            top_logprobs=top_logprobs,
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


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float: the sampled tokens' logprobs
    # [R, k] each, best first; None unless some row asked for top logprobs.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample(logits: torch.Tensor, params: SamplingBatch) -> SampleResult:
    """Sample one token per row of float32 ``logits [R, V]``."""
    greedy = params.temperature <= 0
    scale = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    logprobs = torch.log_softmax(logits / scale.view(-1, 1), dim=-1)
    if params.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        noisy = _truncate(logprobs, params) + _noise(params, logits)
        tokens = torch.where(greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))
    result = SampleResult(tokens, logprobs.gather(1, tokens.view(-1, 1)).view(-1))
    if params.top_logprobs > 0:
        k = min(params.top_logprobs, logprobs.shape[-1])
        result.top_logprobs, result.top_ids = logprobs.topk(k, dim=-1)
    return result


def _noise(params: SamplingBatch, logits: torch.Tensor) -> torch.Tensor:
    if params.all_seeded:
        return gumbel_noise(params.seed, params.step, logits.shape[-1])
    u = torch.rand_like(logits).clamp_(min=1e-10, max=1.0 - 1e-7)
    free = -torch.log(-torch.log(u))
    if not params.any_seeded:
        return free
    seeded = gumbel_noise(params.seed, params.step, logits.shape[-1])
    return torch.where(params.seeded.view(-1, 1), seeded, free)


def _truncate(logprobs: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Set the logprobs of tokens that top_k / top_p / min_p exclude to -inf."""
    if not params.any_truncation:
        return logprobs
    use_k = params.top_k > 0
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
