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

Randomness. Each row samples by Gumbel-max (on CPU, rows that set only a temperature sample
by inverse CDF with one uniform each, ``cpu_kernels``: the same distribution). A seeded
row's noise comes from a counter-based hash of ``(seed, step)``, where ``step`` is the number of tokens the request has already
produced, so a seeded request draws the same tokens whatever else shares its batch, and after
a retraction or a re-prefill. Unseeded rows draw from a device RNG (one fast kernel): the
engine passes its own generator, so a trainer seeding the device's default one never moves it.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
from areal_sdk.backends.embedded import cpu_kernels
from areal_sdk.backends.embedded.transfer import to_device

_M32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, as tensors on the logits' device.

    Only what the rows use is put on the device: truncation parameters when some row
    truncates, seeds and steps when some row is seeded. A plain temperature batch (the RL
    case) costs one host->device copy per step.
    """

    temperature: torch.Tensor  # [R] float; 0 means greedy
    # Host-side summaries, so the common cases need no device->host sync.
    any_seeded: bool
    all_seeded: bool
    all_greedy: bool
    any_truncation: bool
    top_k: torch.Tensor | None = None  # [R] long; -1 disables (set when any_truncation)
    top_p: torch.Tensor | None = None  # [R] float
    min_p: torch.Tensor | None = None  # [R] float
    seed: torch.Tensor | None = None  # [R] long, < 2**31 (set when any_seeded)
    step: torch.Tensor | None = None  # [R] long
    seeded: torch.Tensor | None = None  # [R] bool
    # The largest top_logprobs_num of any row; 0: none asked.
    top_logprobs: int = 0
    # Draws the noise of unseeded rows; None: the device's default generator.
    generator: torch.Generator | None = None

    @classmethod
    def build(
        cls,
        rows: list[tuple[float, int, float, float, int | None, int]],
        device: torch.device,
        top_logprobs: int = 0,
        generator: torch.Generator | None = None,
    ) -> SamplingBatch:
        """``rows`` are ``(temperature, top_k, top_p, min_p, seed or None, step)`` tuples;
        ``top_logprobs`` is the largest number of top logprobs any row wants."""
        t, k, p, mp, raw_seeds, st = zip(*rows, strict=True)
        flags = [x is not None for x in raw_seeds]
        truncation = any(kk > 0 for kk in k) or any(x < 1.0 for x in p) or any(x > 0 for x in mp)
        batch = cls(
            temperature=to_device(t, torch.float32, device),
            any_seeded=any(flags),
            all_seeded=all(flags),
            all_greedy=all(x <= 0 for x in t),
            any_truncation=truncation,
            top_logprobs=top_logprobs,
            generator=generator,
        )
        if truncation:
            batch.top_k = to_device(k, torch.long, device)
            batch.top_p = to_device(p, torch.float32, device)
            batch.min_p = to_device(mp, torch.float32, device)
        if batch.any_seeded:
            s = [x & 0x7FFFFFFF if x is not None else 0 for x in raw_seeds]
            batch.seed = to_device(s, torch.long, device)
            batch.step = to_device(st, torch.long, device)
            batch.seeded = to_device(flags, torch.bool, device)
        return batch


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
    if _cpu_kernel_takes(logits, params):
        tokens, logprobs = cpu_kernels.sample_temperature(
            logits, params.temperature, params.generator
        )
        return SampleResult(tokens, logprobs)
    if _plain_temperature(params) and _fused_sampling(logits) is not None:
        return SampleResult(*sample_temperature(logits, params.temperature, params.generator))
    greedy = params.temperature <= 0
    logprobs = _scaled_logprobs(logits, params.temperature)
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


def _plain_temperature(params: SamplingBatch) -> bool:
    """Rows that set only a temperature: no truncation, no seed, no top logprobs."""
    return not (params.any_truncation or params.any_seeded or params.top_logprobs > 0)


def _cpu_kernel_takes(logits: torch.Tensor, params: SamplingBatch) -> bool:
    """Rows on CPU that set only a temperature go to the inverse-CDF kernel (one uniform per
    row from the same generator, the same distribution as Gumbel-max)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and _plain_temperature(params)
        and cpu_kernels.available()
    )


def _fused_sampling(logits: torch.Tensor):  # type: ignore[no-untyped-def]
    """The one-pass Triton sampler (``areal_sdk.kernels.fused_sampling``) for CUDA logits
    where triton is installed, else None."""
    return _triton_sampler() if logits.is_cuda else None


@functools.cache
def _triton_sampler():  # type: ignore[no-untyped-def]
    # Looked up once: sampling runs every engine step.
    if importlib.util.find_spec("triton") is None:
        return None
    from areal_sdk.kernels import fused_sampling

    return fused_sampling


def sample_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` for rows that set only a temperature (no truncation, no seed, no top
    logprobs): the sampled tokens ``[R]`` and their logprobs ``[R]``. No host sync and no
    data-dependent branch, so a CUDA graph can capture it."""
    greedy = temperature <= 0
    logprobs = _scaled_logprobs(logits, temperature)
    noisy = logprobs + _device_gumbel(logits, generator)
    tokens = torch.where(greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))
    return tokens, logprobs.gather(1, tokens.view(-1, 1)).view(-1)


def _scaled_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row; greedy rows (``T <= 0``) use ``T = 1``."""
    scale = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    return torch.log_softmax(logits / scale.view(-1, 1), dim=-1)


def _device_gumbel(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand(
        logits.shape, device=logits.device, dtype=logits.dtype, generator=generator
    ).clamp_(min=1e-10, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def _noise(params: SamplingBatch, logits: torch.Tensor) -> torch.Tensor:
    if params.all_seeded:
        assert params.seed is not None and params.step is not None
        return gumbel_noise(params.seed, params.step, logits.shape[-1])
    free = _device_gumbel(logits, params.generator)
    if not params.any_seeded:
        return free
    assert params.seed is not None and params.step is not None and params.seeded is not None
    seeded = gumbel_noise(params.seed, params.step, logits.shape[-1])
    return torch.where(params.seeded.view(-1, 1), seeded, free)


def _truncate(logprobs: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Set the logprobs of tokens that top_k / top_p / min_p exclude to -inf."""
    if not params.any_truncation:
        return logprobs
    assert params.top_k is not None and params.top_p is not None and params.min_p is not None
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
