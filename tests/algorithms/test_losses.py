"""Policy losses on numbers checked by hand (every expected value is worked in a comment)."""

from __future__ import annotations

import math

import pytest
import torch

from areal_sdk.algorithms import (
    aggregate,
    aggregation_weight,
    binary_kl,
    importance_weight,
    k3_kl,
    make_loss_fn,
    metric_values,
    mismatch_keep_mask,
    ppo_clip_loss,
)
from areal_sdk.config import AlgorithmConfig, TokenMaskConfig
from areal_sdk.packing import MicroBatch, pack_samples
from areal_sdk.samples import TrainingSample

ln = math.log


def run_loss(result):  # type: ignore[no-untyped-def]
    """(loss, metrics as floats): the metrics come back as tensors, read once by a backend."""
    loss, metrics = result
    return loss, metric_values(metrics)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# --- ppo_clip_loss ---------------------------------------------------------------------------


def test_ppo_clip_symmetric():
    # old = 0, so ratio = exp(logprobs) = 1.5, 0.5, 1.1; clip 0.2 -> ratio range [0.8, 1.2]
    # tok0 A=+1: max(-1.5, -1.2) = -1.2 (clipped)
    # tok1 A=-1: max(0.5, 0.8) = 0.8 (clipped)
    # tok2 A=+1: max(-1.1, -1.1) = -1.1 (inside the range)
    logp = t(ln(1.5), ln(0.5), ln(1.1)).requires_grad_()
    out = ppo_clip_loss(logp, t(0, 0, 0), t(1, -1, 1))
    assert out.loss.tolist() == pytest.approx([-1.2, 0.8, -1.1], abs=1e-6)
    assert out.clipped.tolist() == [True, True, False]
    # d/dlogp of -A*r = -A*r where not clipped (tok2: -1.1), 0 where the clip is active.
    out.loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -1.1], abs=1e-6)


def test_clip_higher_lets_positive_advantages_rise_further():
    # clip_high 0.28: tok0 ratio 1.5 clipped at 1.28 -> -1.28; tok1 floor stays 0.8.
    out = ppo_clip_loss(t(ln(1.5), ln(0.5)), t(0, 0), t(1, -1), clip_low=0.2, clip_high=0.28)
    assert out.loss.tolist() == pytest.approx([-1.28, 0.8], abs=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    # dual_clip 3, A = -1: tok0 ratio 5: max(5, 0.8) = 5 > 3 -> 3 (dual-clipped, no grad)
    #                       tok1 ratio 2: max(2, 0.8) = 2 < 3 -> 2 (unclipped)
    # A = +1, ratio 5: max(-5, -1.2) = -1.2, dual-clip does not apply to A > 0.
    logp = t(ln(5), ln(2), ln(5)).requires_grad_()
    out = ppo_clip_loss(logp, t(0, 0, 0), t(-1, -1, 1), dual_clip=3.0)
    assert out.loss.tolist() == pytest.approx([3.0, 2.0, -1.2], abs=1e-5)
    assert out.dual_clipped.tolist() == [True, False, False]
    assert out.clipped.tolist() == [False, False, True]
    out.loss.sum().backward()
    # tok1: d(-A r)/dlogp = r = 2
    assert logp.grad.tolist() == pytest.approx([0.0, 2.0, 0.0], abs=1e-5)


# --- importance weight, binary KL, masks, k3 -------------------------------------------------


def test_importance_weight_is_a_constant():
    prox = t(ln(0.5)).requires_grad_()
    w = importance_weight(prox, t(ln(0.25)))  # 0.5 / 0.25 = 2
    assert w.item() == pytest.approx(2.0)
    assert not w.requires_grad


def test_binary_kl_by_hand():
    # p = 0.5, q = 0.25: 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.346574 - 0.202733 = 0.143841
    # p = 0.25, q = 0.5: 0.25 ln(0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099 = 0.130812
    # p = q: 0;  p = 1, q = 0.5: 1 * ln 2 + 0 = 0.693147 (finite despite log(1 - p))
    kl = binary_kl(t(ln(0.5), ln(0.25), ln(0.3), 0.0), t(ln(0.25), ln(0.5), ln(0.3), ln(0.5)))
    assert kl.tolist() == pytest.approx([0.143841, 0.130812, 0.0, 0.693147], abs=1e-5)


def test_ratio_mask_keeps_inside_bounds():
    # w = prox/behav = 2.5, 1, 0.4 with bounds [0.5, 2]: keep only the middle one.
    keep = mismatch_keep_mask(t(0, 0, 0), t(ln(2.5), 0, ln(0.4)), "ratio", 0.5, 2.0)
    assert keep.tolist() == [False, True, False]
    assert mismatch_keep_mask(t(0), t(ln(9)), "none", 0, 1).tolist() == [True]


def test_k3_kl_by_hand():
    # d = ref - logp = ln 2: e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853; d = 0 gives 0.
    assert k3_kl(t(0.0, -1.0), t(ln(2), -1.0)).tolist() == pytest.approx([0.306853, 0.0], abs=1e-6)


# --- aggregation -----------------------------------------------------------------------------


def test_aggregation_modes_by_hand():
    # Three sequences: [1, 2, 3] [4, 5] [6]; mask [0, 1, 1] [0, 1] [0] (the last has none).
    loss, mask, cu = t(1, 2, 3, 4, 5, 6), t(0, 1, 1, 0, 1, 0), torch.tensor([0, 3, 5, 6])
    # token mean: (2 + 3 + 5) / 3 = 10/3
    assert aggregate(loss, mask, cu, "token_mean").item() == pytest.approx(10 / 3)
    # per sequence mean: (2 + 3)/2 = 2.5 and 5/1 = 5 -> (2.5 + 5) / 2 = 3.75; seq 3 not counted
    assert aggregate(loss, mask, cu, "seq_mean_token_mean").item() == pytest.approx(3.75)
    # per sequence sum: 5 and 5 -> 5
    assert aggregate(loss, mask, cu, "seq_mean_token_sum").item() == pytest.approx(5.0)
    assert aggregation_weight(mask, cu, "token_mean") == 3
    assert aggregation_weight(mask, cu, "seq_mean_token_mean") == 2


def test_empty_mask_gives_zero_with_grad():
    x = t(1.0, 2.0).requires_grad_()
    out = aggregate(x, t(0, 0), torch.tensor([0, 2]), "token_mean")
    out.backward()
    assert out.item() == 0.0 and x.grad.tolist() == [0.0, 0.0]


# --- the loss_fn a trainer calls -------------------------------------------------------------
#
# Sequence A: 3 tokens (1 prompt, 2 sampled), advantage +1.
# Sequence B: 2 tokens (1 prompt, 1 sampled), advantage -1.
# Per sampled token (tok1, tok2 of A; tok4 = B's second):
#   behaviour  0.5   0.5   0.25
#   proximal   0.5   0.25  0.5    -> importance weight w = 1, 0.5, 2
#   current    0.75  0.25  0.5    -> ratio vs proximal r = 1.5, 1, 1
#   version    3     4     2      (current version 5 -> staleness 2, 1, 3)
# Decoupled, clip 0.2:
#   tok1: A=+1, r=1.5 -> clipped at 1.2 -> -1.2 * w 1   = -1.2
#   tok2: A=+1, r=1   -> -1          * w 0.5 = -0.5
#   tok4: A=-1, r=1   -> +1          * w 2   = +2
#   token mean (-1.2 - 0.5 + 2) / 3 = 0.1; clip fraction 1/3.

BEHAV_A, BEHAV_B = [0.0, ln(0.5), ln(0.5)], [0.0, ln(0.25)]
PROX = [0.0, ln(0.5), ln(0.25), 0.0, ln(0.5)]
CURRENT = [0.0, ln(0.75), ln(0.25), 0.0, ln(0.5)]


def _samples() -> list[TrainingSample]:
    a = TrainingSample("ea", "g", "t", ["u"], [10, 11, 12], [0, 1, 1], BEHAV_A, [-1, 3, 4], 1.0)
    b = TrainingSample("eb", "g", "t", ["u"], [20, 21], [0, 1], BEHAV_B, [-1, 2], 0.0)
    return [a, b]


def _one_batch() -> MicroBatch:
    [[mb]] = pack_samples(_samples(), [1.0, -1.0], max_tokens=16)
    mb.proximal_logprobs = torch.tensor(PROX)
    return mb


def test_decoupled_loss_by_hand():
    mb = _one_batch()
    logp = torch.tensor(CURRENT, requires_grad=True)
    loss, m = run_loss(make_loss_fn(AlgorithmConfig(), current_version=5)(logp, torch.ones(5), mb))
    assert loss.item() == pytest.approx(0.1, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["masked_frac"] == 0.0
    assert m["staleness_mean"] == pytest.approx(2.0) and m["staleness_max"] == 3.0
    assert m["importance_weight"] == pytest.approx((1 + 0.5 + 2) / 3)
    assert m["entropy"] == pytest.approx(1.0)
    assert m["n_tokens"] == 3 and m["n_seqs"] == 2
    loss.backward()
    # d/dlogp of -A r w / 3: tok1 clipped -> 0; tok2 -1*1*0.5/3 = -1/6; tok4 +1*1*2/3 = 2/3
    assert logp.grad.tolist() == pytest.approx([0, 0, -1 / 6, 0, 2 / 3], abs=1e-6)


def test_ratio_token_mask_drops_gradient_but_keeps_the_denominator():
    # upper 1.5 masks tok4 (w = 2): (-1.2 - 0.5) / 3 = -0.566667, masked fraction 1/3
    cfg = AlgorithmConfig(token_mask=TokenMaskConfig(metric="ratio", lower=0.5, upper=1.5))
    loss, m = run_loss(make_loss_fn(cfg, 5)(torch.tensor(CURRENT), None, _one_batch()))
    assert loss.item() == pytest.approx(-1.7 / 3, abs=1e-6)
    assert m["masked_frac"] == pytest.approx(1 / 3)


def test_kl_token_mask():
    # binary KL(behaviour || proximal): tok1 0, tok2 (p .5, q .25) 0.143841, tok4 (p .25, q .5)
    # 0.130812. upper 0.135 masks tok2 only: (-1.2 + 2) / 3 = 0.266667
    cfg = AlgorithmConfig(token_mask=TokenMaskConfig(metric="kl", upper=0.135))
    loss, m = run_loss(make_loss_fn(cfg, 5)(torch.tensor(CURRENT), None, _one_batch()))
    assert loss.item() == pytest.approx(0.8 / 3, abs=1e-6)
    assert m["masked_frac"] == pytest.approx(1 / 3)


def test_sequence_mean_aggregation():
    # A: (-1.2 - 0.5) / 2 = -0.85; B: 2 -> (-0.85 + 2) / 2 = 0.575
    cfg = AlgorithmConfig(loss_agg="seq_mean_token_mean")
    loss, _ = make_loss_fn(cfg, 5)(torch.tensor(CURRENT), None, _one_batch())
    assert loss.item() == pytest.approx(0.575, abs=1e-6)


def test_non_decoupled_ratio_is_against_behaviour_with_dual_clip():
    # ratio current/behaviour: tok1 0.75/0.5 = 1.5 -> -1.2 (clipped)
    # tok2 0.25/0.5 = 0.5, A=+1: max(-0.5, -0.8) = -0.5
    # tok4 0.5/0.25 = 2, A=-1: max(2, 0.8) = 2, dual clip 1.5 -> 1.5
    # (-1.2 - 0.5 + 1.5) / 3 = -0.0666667
    cfg = AlgorithmConfig(decoupled=False, dual_clip=1.5)
    loss, m = run_loss(make_loss_fn(cfg, 5)(torch.tensor(CURRENT), None, _one_batch()))
    assert loss.item() == pytest.approx(-0.2 / 3, abs=1e-6)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)


def test_reference_kl_term():
    # ref = current except tok1 where ref - logp = ln 2: k3 = 0.306853
    # loss = 0.1 + 0.1 * 0.306853 / 3 = 0.110228
    mb = _one_batch()
    ref = torch.tensor(CURRENT)
    ref[1] += ln(2)
    mb.ref_logprobs = ref
    loss, m = run_loss(
        make_loss_fn(AlgorithmConfig(kl_coef=0.1), 5)(torch.tensor(CURRENT), None, mb)
    )
    assert loss.item() == pytest.approx(0.1 + 0.1 * 0.306853 / 3, abs=1e-6)
    assert m["ref_kl"] == pytest.approx(0.306853 / 3, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_loss_fn(AlgorithmConfig(kl_coef=0.1), 5)(torch.tensor(CURRENT), None, _one_batch())


def test_entropy_bonus():
    # entropy 0.3 on every token, coef 0.5: 0.1 - 0.5 * 0.3 = -0.05
    cfg = AlgorithmConfig(entropy_coef=0.5)
    loss, _ = make_loss_fn(cfg, 5)(torch.tensor(CURRENT), torch.full((5,), 0.3), _one_batch())
    assert loss.item() == pytest.approx(-0.05, abs=1e-6)


def test_without_proximal_the_current_policy_is_proximal():
    # r = 1 everywhere, w = current/behaviour: tok1 1.5, tok2 0.5, tok4 2
    # (-1 * 1.5 - 1 * 0.5 + 1 * 2) / 3 = 0
    mb = _one_batch()
    mb.proximal_logprobs = None
    loss, m = run_loss(make_loss_fn(AlgorithmConfig(), 5)(torch.tensor(CURRENT), None, mb))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_weighted_micro_batches_equal_one_batch(agg):
    # Budget 3 puts A and B in separate micro-batches; sum(weight * loss) / sum(weight) must
    # equal the loss over both at once, for every aggregation.
    cfg = AlgorithmConfig(loss_agg=agg)
    loss_fn = make_loss_fn(cfg, 5)
    whole, _ = loss_fn(torch.tensor(CURRENT), None, _one_batch())
    [parts] = pack_samples(_samples(), [1.0, -1.0], max_tokens=3)
    assert len(parts) == 2
    offsets = {0: slice(0, 3), 1: slice(3, 5)}
    total, weights = 0.0, 0
    for mb in parts:
        [i] = mb.sample_indices
        mb.proximal_logprobs = torch.tensor(PROX[offsets[i]])
        loss, _ = loss_fn(torch.tensor(CURRENT[offsets[i]]), None, mb)
        total += loss_fn.weight(mb) * loss.item()
        weights += loss_fn.weight(mb)
    assert total / weights == pytest.approx(whole.item(), abs=1e-6)


def test_padding_micro_batch_contributes_nothing():
    # One sample on two ranks: rank 1 gets a one-token padding micro-batch.
    ranks = pack_samples(_samples()[:1], [1.0], max_tokens=16, num_ranks=2)
    pad = ranks[1][0]
    logp = torch.zeros(1, requires_grad=True)
    loss, m = run_loss(make_loss_fn(AlgorithmConfig(), 5)(logp, None, pad))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.tolist() == [0.0]
    assert make_loss_fn(AlgorithmConfig(), 5).weight(pad) == 0 and m["n_tokens"] == 0
