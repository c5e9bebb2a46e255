"""AdamW with its moments in bfloat16 against torch's float32 AdamW, and the config key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train.optimizer import (
    NOISE_WINDOW,
    CompactAdamW,
    RoundingNoise,
    optimizer_state_dtype,
    store_rounded,
)
from areal_sdk.backends.train.torch_backend import TorchBackend

from areal_sdk.config import ConfigError, load_config
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config


def moments_of(backend: TorchBackend) -> set[torch.dtype]:
    return {s[k].dtype for s in backend.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")}


def test_bf16_moments_update_like_torch_adamw() -> None:
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=g), torch.randn(300, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) * 1e-2 for p in start] for _ in range(5)]
    params = {name: [torch.nn.Parameter(p.clone()) for p in start] for name in ("f32", "bf16")}
    settings = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    reference = torch.optim.AdamW(params["f32"], fused=True, **settings)
    compact = CompactAdamW(params["bf16"], state_dtype=torch.bfloat16, fused=True, **settings)
    for step_grads in grads:
        for optimizer, ps in ((reference, params["f32"]), (compact, params["bf16"])):
            for p, grad in zip(ps, step_grads, strict=True):
                p.grad = grad.clone()
            optimizer.step()
    for p in params["bf16"]:
        assert {compact.state[p]["exp_avg"].dtype, compact.state[p]["exp_avg_sq"].dtype} == {
            torch.bfloat16
        }
    for ref, got, p0 in zip(params["f32"], params["bf16"], start, strict=True):
        # The weights moved by a few lr; bf16 moments change that by about 1% of it.
        moved = float((ref.detach() - p0).abs().mean())
        assert moved > 1e-3
        torch.testing.assert_close(got.detach() - p0, ref.detach() - p0, atol=moved * 0.05, rtol=0)


def test_a_backend_with_bf16_moments_trains_like_float32_ones(tiny_model_dir: Path) -> None:
    batches = micro_batches(40)[0]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        backend = TorchBackend(tiny_model_dir, train_config(optimizer_state_dtype=dtype))
        losses = [backend.train_step(batches, loss_fn(k))["loss"] for k in range(4)]
        runs[dtype] = (backend, losses)
    assert moments_of(runs["float32"][0]) == {torch.float32}
    assert moments_of(runs["bfloat16"][0]) == {torch.bfloat16}
    torch.testing.assert_close(runs["bfloat16"][1], runs["float32"][1], rtol=0.02, atol=1e-3)
    probe = [single(FIXED_SEQUENCE)]
    start = TorchBackend(tiny_model_dir, train_config()).forward_logprobs(probe)[0]
    f32, bf16 = (runs[d][0].forward_logprobs(probe)[0] for d in ("float32", "bfloat16"))
    # Both learned the same thing: what they compute moved alike, far beyond their difference.
    assert (bf16 - f32).abs().max() < 0.1 * (f32 - start).abs().max()


def test_a_checkpoint_keeps_the_moments_compact(tiny_model_dir: Path, tmp_path: Path) -> None:
    batches = micro_batches(40)[0]
    f32 = TorchBackend(tiny_model_dir, train_config(optimizer_state_dtype="float32"))
    f32.train_step(batches, loss_fn())
    f32.save(tmp_path / "f32")
    resumed = TorchBackend(tiny_model_dir, train_config(optimizer_state_dtype="bfloat16"))
    resumed.load(tmp_path / "f32")  # a float32 checkpoint, from before the key existed
    assert moments_of(resumed) == {torch.bfloat16}
    resumed.train_step(batches, loss_fn(1))
    resumed.save(tmp_path / "bf16")
    again = TorchBackend(tiny_model_dir, train_config(optimizer_state_dtype="bfloat16"))
    again.load(tmp_path / "bf16")
    assert moments_of(again) == {torch.bfloat16}
    assert again.step == 2
    back = TorchBackend(tiny_model_dir, train_config(optimizer_state_dtype="float32"))
    back.load(tmp_path / "bf16")
    assert moments_of(back) == {torch.float32}
    back.train_step(batches, loss_fn(2))


def test_auto_is_float32_and_bfloat16_is_asked_for() -> None:
    assert optimizer_state_dtype("auto", torch.device("cpu")) == torch.float32
    assert optimizer_state_dtype("auto", torch.device("cuda")) == torch.float32
    assert optimizer_state_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert optimizer_state_dtype("float32", torch.device("cpu")) == torch.float32
    assert optimizer_state_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16


def test_the_config_key_rejects_what_it_cannot_do() -> None:
    assert load_config(None, []).train.optimizer_state_dtype == "auto"
    with pytest.raises(ConfigError, match="train.optimizer_state_dtype: Input should be 'auto'"):
        load_config(None, ["train.optimizer_state_dtype=float16"])
    with pytest.raises(ConfigError, match="bfloat16 is the torch backend's"):
        load_config(None, ["train.backend=deepspeed", "train.optimizer_state_dtype=bfloat16"])


def test_bf16_second_moments_keep_moving_over_many_steps() -> None:
    """Rounded to nearest, a bfloat16 second moment freezes once a step changes it by less
    than half its resolution (0.1% a step at beta2 = 0.999): stochastic rounding keeps it on
    float32's course."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=g)
    grads = [torch.randn(4096, generator=g) * (0.5 if k < 200 else 2.0) for k in range(1000)]
    params = {name: torch.nn.Parameter(start.clone()) for name in ("f32", "bf16")}
    settings = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8}
    reference = torch.optim.AdamW([params["f32"]], fused=True, **settings)
    compact = CompactAdamW([params["bf16"]], state_dtype=torch.bfloat16, fused=True, **settings)
    for grad in grads:
        for optimizer, p in ((reference, params["f32"]), (compact, params["bf16"])):
            p.grad = grad.clone()
            optimizer.step()
    want = reference.state[params["f32"]]["exp_avg_sq"].mean()
    got = compact.state[params["bf16"]]["exp_avg_sq"].float().mean()
    # The gradients grew 4x after step 200: the second moment climbs for the rest of the run.
    assert float(want) > 1.5
    assert abs(float(got) / float(want) - 1) < 0.01  # 4% off when rounded to nearest


def test_stochastic_rounding_covers_and_is_unbiased_past_one_noise_window() -> None:
    n = NOISE_WINDOW * 2 + 12_345
    low = torch.full((n,), 1.0, dtype=torch.bfloat16)
    ulp = 2.0**-7  # bfloat16's step between 1 and 2
    source = low.float() + 0.25 * ulp
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    store_rounded(source, out, RoundingNoise(torch.device("cpu")))
    assert not out.isnan().any()
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + ulp}
    up = (out.float() > 1.0).float()
    # Each window rounds up a quarter of the time, the short tail included.
    for part in (up[:NOISE_WINDOW], up[NOISE_WINDOW : 2 * NOISE_WINDOW], up[2 * NOISE_WINDOW :]):
        assert abs(float(part.mean()) - 0.25) < 0.02
