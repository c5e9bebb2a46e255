"""Policy losses as pure functions of per-token tensors, and the ``loss_fn`` a trainer calls.

Three log-probabilities of each sampled token meet here:

- ``behaviour``: what the inference engine reported when it sampled the token (possibly
  several weight versions ago, possibly with a different numerics stack);
- ``proximal``: the trainer's own recomputation under the weights at the start of this
  update (``MicroBatch.proximal_logprobs``);
- ``logprobs``: the current policy, with gradient.

The decoupled PPO objective (AReaL, Hilton et al. 2022) clips the ratio against the
proximal policy, and corrects for the behaviour policy having sampled the data with the
importance weight ``pi_proximal / pi_behaviour`` (a constant, no gradient)::

    r   = exp(logprobs - proximal)
    w   = exp(proximal - behaviour)
    l_t = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))       (PPO, clip-higher)
    l_t = min(l_t, -A * dual_clip * w)          where A < 0                (dual-clip)

Tokens whose behaviour/proximal mismatch is out of ``[lower, upper]`` are masked (IcePop:
ratio ``w``; KPop-style: binary KL). Non-decoupled PPO takes the ratio against the behaviour
logprobs and uses ``w = 1``. A k3 KL to a
reference model and an entropy bonus are optional. Per-token losses are aggregated by
token mean or by sequence mean (see ``aggregate``).

Every function takes flat [N] tensors aligned like ``MicroBatch.input_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from areal_sdk.config import AlgorithmConfig
from areal_sdk.packing import MicroBatch

LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
MaskMetric = Literal["none", "ratio", "kl"]
# exp() of a log-ratio above this overflows float32; such a token is garbage either way.
_MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLoss:
    """Per-token PPO loss and which tokens clipping touched."""

    loss: torch.Tensor  # [N] float32, before importance weighting
    clipped: torch.Tensor  # [N] bool, the clip bound is the active term
    dual_clipped: torch.Tensor  # [N] bool, the dual-clip bound is the active term


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate (negated, to minimise) per token.

    ``clip_high > clip_low`` is DAPO's clip-higher: positive-advantage tokens may raise their
    probability further before the clip stops them. ``dual_clip = c > 1`` bounds the loss of
    a negative-advantage token by ``-c A`` so a huge ratio cannot dominate (Ye et al. 2020).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    dual = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
    return PolicyLoss(loss=loss, clipped=is_clipped & ~dual, dual_clipped=dual)


def importance_weight(proximal: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """``pi_proximal / pi_behaviour`` of the sampled token, without gradient."""
    log_w = (proximal - behaviour).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_w)


def _log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, finite at logp = 0 (clamped to a tiny probability)."""
    return torch.log((-torch.expm1(logp.clamp(max=0.0))).clamp(min=1e-12))


def binary_kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) || Bernoulli(q)) per token, from the two logprobs of the sampled token.

    The event is "the sampled token / any other token". By the data-processing inequality
    this lower-bounds the KL between the full next-token distributions, yet needs nothing
    but the two scalars every engine reports.
    """
    p_logprobs = p_logprobs.clamp(max=0.0)
    q_logprobs = q_logprobs.clamp(max=0.0)
    p = torch.exp(p_logprobs)
    kl = p * (p_logprobs - q_logprobs) + (1.0 - p) * (_log1mexp(p_logprobs) - _log1mexp(q_logprobs))
    return kl.clamp(min=0.0)


def mismatch_keep_mask(
    behaviour: torch.Tensor,
    proximal: torch.Tensor,
    metric: MaskMetric,
    lower: float,
    upper: float,
) -> torch.Tensor:
    """True where the behaviour/proximal mismatch is inside ``[lower, upper]`` (token kept).

    ``ratio``: ``pi_proximal / pi_behaviour`` (IcePop); ``kl``: ``binary_kl(behaviour,
    proximal)``; ``none``: keep all.
    """
    if metric == "none":
        return torch.ones_like(behaviour, dtype=torch.bool)
    if metric == "ratio":
        value = importance_weight(proximal, behaviour)
    elif metric == "kl":
        value = binary_kl(behaviour.detach(), proximal.detach())
    else:
        raise ValueError(f"unknown token mask metric {metric!r}; use none, ratio or kl")
    return (value >= lower) & (value <= upper)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: ``e^d - d - 1``, d = ref - pi.

    Unbiased under samples from pi, never negative, low variance.
    """
    d = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def sequence_index(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] int64: which sequence each token belongs to."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    # Checked where it costs nothing; on a GPU the check would stall the host mid-step.
    if cu_seqlens.device.type == "cpu" and int(lens.sum()) != num_tokens:
        raise ValueError(f"cu_seqlens covers {int(lens.sum())} tokens, tensors have {num_tokens}")
    index = torch.arange(lens.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(index, lens, output_size=num_tokens)


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: LossAgg
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the tokens where ``mask`` is 1.

    - ``token_mean``: sum over tokens / number of tokens; long answers weigh more.
    - ``seq_mean_token_mean``: mean within each sequence, then mean over sequences.
    - ``seq_mean_token_sum``: sum within each sequence, then mean over sequences.

    Sequences without a masked-in token do not count. An empty mask gives 0 (with grad).
    The scalar is a mean over ``aggregation_weight(mask, cu_seqlens, mode)`` units.
    """
    mask = mask.to(loss.dtype)
    masked = loss * mask
    if mode == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if mode not in ("seq_mean_token_sum", "seq_mean_token_mean"):
        raise ValueError(f"unknown loss aggregation {mode!r}")
    seq = sequence_index(cu_seqlens, loss.numel())
    n_seqs = cu_seqlens.numel() - 1
    seq_sum = torch.zeros(n_seqs, dtype=loss.dtype, device=loss.device).index_add(0, seq, masked)
    seq_tokens = torch.zeros(n_seqs, dtype=loss.dtype, device=loss.device).index_add(0, seq, mask)
    present = seq_tokens > 0
    if mode == "seq_mean_token_mean":
        seq_sum = seq_sum / seq_tokens.clamp(min=1.0)
    return (seq_sum * present).sum() / present.sum().clamp(min=1)


def aggregation_weight(mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: LossAgg) -> int:
    """How many units ``aggregate`` averaged over: tokens, or sequences with a masked-in token.

    To combine micro-batches into the loss of the whole batch, weight each micro-batch's
    loss by this and divide by the total, and the result does not depend on the split.
    """
    if mode == "token_mean":
        return int((mask > 0).sum())
    return int(sequences_with_tokens(mask, cu_seqlens))


def sequences_with_tokens(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """0-d tensor, on ``mask``'s device: how many sequences have a masked-in token."""
    seq = sequence_index(cu_seqlens, mask.numel())
    per_seq = torch.zeros(cu_seqlens.numel() - 1, device=mask.device).index_add(
        0, seq, (mask > 0).float()
    )
    return (per_seq > 0).sum()


K = TypeVar("K")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # 0 where nothing is masked in (the numerator is 0 then too).
    return (x * mask).sum() / mask.sum().clamp(min=1)


def metric_values(metrics: Mapping[K, float | torch.Tensor]) -> dict[K, float]:
    """Metrics as floats, reading every tensor among them in one device-to-host copy.

    The loss function returns its metrics as 0-d tensors so that a training step never waits
    for the GPU between a micro-batch's forward and its backward; a backend reads them all
    once, after the step's work is queued.
    """
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        tensors = [metrics[k].detach().float().reshape(()) for k in keys]  # type: ignore[union-attr]
        on = tensors[0].device
        values = torch.stack([t.to(on) for t in tensors]).tolist()
        out.update(zip(keys, values, strict=True))
    return out


@dataclass(frozen=True)
class PPOLossFn:
    """``loss_fn(logprobs, entropy, batch) -> (loss, metrics)`` built from ``AlgorithmConfig``.

    ``loss`` is a mean over ``weight(batch)`` units (tokens or sequences, per ``loss_agg``);
    a trainer accumulating micro-batches scales each by ``weight(batch) / total weight`` so
    the step does not depend on how samples were split.

    Without ``batch.proximal_logprobs`` the proximal policy is taken to be the current one
    (``logprobs.detach()``): exact for the first optimizer step on a batch, since the weights
    have not moved yet. A ``kl_coef > 0`` requires ``batch.ref_logprobs``.
    """

    cfg: AlgorithmConfig
    current_version: int

    def weight(self, batch: MicroBatch) -> int:
        return aggregation_weight(batch.loss_mask, batch.cu_seqlens, self.cfg.loss_agg)

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        if logprobs.shape != batch.loss_mask.shape:
            raise ValueError(
                f"logprobs has shape {tuple(logprobs.shape)}, the micro-batch has "
                f"{tuple(batch.loss_mask.shape)} tokens"
            )
        logprobs = logprobs.float()
        mask = batch.loss_mask.float()
        behaviour = batch.behaviour_logprobs.float()
        proximal = (
            batch.proximal_logprobs.float().detach()
            if batch.proximal_logprobs is not None
            else logprobs.detach()
        )
        keep = mismatch_keep_mask(
            behaviour, proximal, cfg.token_mask.metric, cfg.token_mask.lower, cfg.token_mask.upper
        )
        loss_mask = mask * keep.float()

        policy = ppo_clip_loss(
            logprobs,
            proximal if cfg.decoupled else behaviour,
            batch.advantages.float(),
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip,
        )
        weight = importance_weight(proximal, behaviour) if cfg.decoupled else None
        token_loss = policy.loss * weight if weight is not None else policy.loss

        ref_kl = None
        if cfg.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError(
                    "algorithm.kl_coef > 0 needs reference logprobs (MicroBatch.ref_logprobs)"
                )
            ref_kl = k3_kl(logprobs, batch.ref_logprobs.float().detach())
            token_loss = token_loss + cfg.kl_coef * ref_kl
        if cfg.entropy_coef > 0:
            if entropy is None:
                raise ValueError("algorithm.entropy_coef > 0 needs the entropy from the backend")
            token_loss = token_loss - cfg.entropy_coef * entropy.float()

        # Token-masked tokens keep their place in the denominator: masking removes their
        # gradient without making the other tokens of the batch weigh more.
        loss = aggregate(token_loss * keep.float(), mask, batch.cu_seqlens, cfg.loss_agg)
        metrics = self._metrics(logprobs, entropy, batch, mask, loss_mask, proximal, behaviour)
        metrics.update(
            {
                "loss": loss.detach(),
                "clip_frac": _masked_mean(policy.clipped.float(), loss_mask),
                "dual_clip_frac": _masked_mean(policy.dual_clipped.float(), loss_mask),
            }
        )
        if ref_kl is not None:
            metrics["ref_kl"] = _masked_mean(ref_kl.detach(), loss_mask)
        return loss, metrics

    def _metrics(
        self,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        batch: MicroBatch,
        mask: torch.Tensor,
        loss_mask: torch.Tensor,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        n = mask.sum()
        staleness = (self.current_version - batch.versions.to(mask.device)).float()
        sampled = mask > 0
        metrics = {
            "n_tokens": n,
            "n_seqs": sequences_with_tokens(mask, batch.cu_seqlens).float(),
            "masked_frac": torch.where(n > 0, 1.0 - loss_mask.sum() / n.clamp(min=1), 0.0),
            # KL(proximal || current) by k3: how far this update has moved the policy.
            "approx_kl": _masked_mean(k3_kl(logprobs.detach(), proximal), mask),
            # The train/inference mismatch plus staleness, as the engine saw it.
            "behaviour_kl": _masked_mean(binary_kl(behaviour, proximal), mask),
            "importance_weight": _masked_mean(importance_weight(proximal, behaviour), mask),
            "staleness_mean": _masked_mean(staleness, mask),
            "staleness_max": torch.where(
                n > 0, staleness.masked_fill(~sampled, float("-inf")).max(), 0.0
            ),
        }
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy.detach().float(), mask)
        return metrics


def make_loss_fn(cfg: AlgorithmConfig, current_version: int) -> PPOLossFn:
    """The ``loss_fn`` for one training step at weight version ``current_version``."""
    return PPOLossFn(cfg=cfg, current_version=current_version)
