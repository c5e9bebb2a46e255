"""The torch train backend on the tiny model: logprobs, steps, checkpoints, sync buckets."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train import plugin
from areal_sdk.backends.train.torch_backend import TorchBackend
from safetensors import safe_open

from areal_sdk.config import Config
from areal_sdk.plugin_host import PluginHost
from tests.backends.train.common import (
    FIXED_SEQUENCE,
    loss_fn,
    make_samples,
    micro_batches,
    single,
    train_config,
)


def run_steps(backend: TorchBackend, batches, steps: int, first: int = 0) -> list[float]:
    return [backend.train_step(batches, loss_fn(first + k))["loss"] for k in range(steps)]


def test_logprobs_equal_the_hf_model_run_on_each_sequence_alone(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(tiny_model_dir, train_config())
    # Every sample packed into one row; the head on every row, prompts included.
    batch = dataclasses.replace(micro_batches(10_000)[0][0], head_rows=None)
    packed = backend.forward_logprobs([batch])[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples, _ = make_samples()
    bounds = batch.cu_seqlens.tolist()
    for k, index in enumerate(batch.sample_indices):
        ids = torch.tensor(samples[index].input_ids)
        with torch.no_grad():
            logits = reference(ids[None]).logits[0].float()
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        got = packed[bounds[k] : bounds[k + 1]]
        assert got[0] == 0.0  # no prediction for a sequence's first token
        torch.testing.assert_close(got[1:], expected, atol=1e-5, rtol=1e-5)


def test_the_head_skips_prompt_rows_and_the_update_stays_the_same(tiny_model_dir: Path) -> None:
    rows_only = TorchBackend(tiny_model_dir, train_config())
    every_row = TorchBackend(tiny_model_dir, train_config())
    batch = micro_batches(10_000)[0][0]
    whole = dataclasses.replace(batch, head_rows=None)
    trained = batch.loss_mask > 0
    assert batch.head_rows is not None and len(batch.head_rows) == int(trained.sum()) + 1
    got, full = rows_only.forward_logprobs([batch])[0], every_row.forward_logprobs([whole])[0]
    torch.testing.assert_close(got[trained], full[trained], atol=1e-6, rtol=0)
    assert (got[~trained] == 0).all() and (full[~trained] != 0).any()
    torch.testing.assert_close(
        run_steps(rows_only, [batch], 3), run_steps(every_row, [whole], 3), rtol=1e-5, atol=1e-7
    )
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(
        rows_only.forward_logprobs(probe), every_row.forward_logprobs(probe), atol=1e-5, rtol=0
    )


def test_the_update_does_not_depend_on_how_samples_are_split(tiny_model_dir: Path) -> None:
    one = TorchBackend(tiny_model_dir, train_config())
    many = TorchBackend(tiny_model_dir, train_config())
    whole, split = micro_batches(10_000)[0], micro_batches(40)[0]
    assert len(whole) == 1 and len(split) >= 3
    torch.testing.assert_close(
        run_steps(one, whole, 3), run_steps(many, split, 3), rtol=1e-5, atol=1e-7
    )
    # Weights agree to rounding; Adam can amplify rounding in near-zero gradients, so the
    # check is on what the weights compute.
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(
        one.forward_logprobs(probe), many.forward_logprobs(probe), atol=1e-4, rtol=0
    )
    assert one.step == many.step == 3 and one.version == 3


def test_training_follows_the_advantages(tiny_model_dir: Path) -> None:
    backend = TorchBackend(tiny_model_dir, train_config())
    batches = micro_batches(10_000)[0]
    before = backend.forward_logprobs(batches)[0]
    metrics = backend.train_step(batches, loss_fn())
    after = backend.forward_logprobs(batches)[0]
    assert metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
    assert metrics["n_tokens"] == float(batches[0].loss_mask.sum())
    _, advantages = make_samples()
    bounds = batches[0].cu_seqlens.tolist()
    for k, index in enumerate(batches[0].sample_indices):
        lo, hi = bounds[k], bounds[k + 1]
        mask = batches[0].loss_mask[lo:hi] > 0
        moved = (after[lo:hi] - before[lo:hi])[mask].mean()
        assert moved * advantages[index] > 0, (index, float(moved))


def test_gradient_checkpointing_gives_the_same_losses(tiny_model_dir: Path) -> None:
    plain = TorchBackend(tiny_model_dir, train_config())
    checkpointed = TorchBackend(tiny_model_dir, train_config(gradient_checkpointing=True))
    batches = micro_batches(40)[0]
    torch.testing.assert_close(run_steps(plain, batches, 2), run_steps(checkpointed, batches, 2))


def test_save_and_load_continue_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    batches = micro_batches(40)[0]
    first = TorchBackend(tiny_model_dir, train_config())
    run_steps(first, batches, 2)
    first.save(tmp_path / "ckpt")
    expected = run_steps(first, batches, 2, first=2)

    resumed = TorchBackend(tiny_model_dir, train_config())
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2 and resumed.version == 2
    assert run_steps(resumed, batches, 2, first=2) == expected


def test_loading_a_missing_checkpoint_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = TorchBackend(tiny_model_dir, train_config())
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        backend.load(tmp_path)


def test_state_for_sync_yields_every_weight_under_its_hf_name_in_buckets(
    tiny_model_dir: Path,
) -> None:
    backend = TorchBackend(tiny_model_dir, train_config())
    bucket_bytes = 64 * 1024
    buckets = list(backend.state_for_sync(bucket_bytes))
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1
    names = [n for bucket in buckets for n, _ in bucket]
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys())
    assert len(names) == len(set(names)) and set(names) == on_disk


def test_a_batch_with_nothing_to_learn_leaves_the_weights(tiny_model_dir: Path) -> None:
    backend = TorchBackend(tiny_model_dir, train_config())
    batch = single(FIXED_SEQUENCE)
    batch.loss_mask.zero_()
    before = backend.forward_logprobs([batch])[0]
    metrics = backend.train_step([batch], loss_fn())
    assert metrics["skipped"] == 1.0 and backend.step == 0
    assert torch.equal(backend.forward_logprobs([batch])[0], before)


def test_the_plugin_registers_both_backends_and_every_sync_method(tiny_model_dir: Path) -> None:
    host = PluginHost(load_entry_points=False)
    host.register(plugin, "train")
    assert {"torch", "deepspeed"} <= set(host.train_backends())
    assert {"in_process", "disk", "broadcast", "cuda_ipc"} <= set(host.weight_sync_methods())
    config = Config.model_validate({"model": {"path": str(tiny_model_dir)}, "train": {"lr": 1e-3}})
    backend = host.train_backend("torch")(config)
    assert isinstance(backend, TorchBackend) and backend.optimizer.param_groups[0]["lr"] == 1e-3


def test_padded_and_packed_attention_agree_forward_and_backward(tiny_model_dir: Path) -> None:
    """The right-padded batch (flash-able SDPA) and the one packed row with a block-diagonal
    mask are the same computation."""
    padded = TorchBackend(tiny_model_dir, train_config(attn_implementation="sdpa"))
    padded.model.padded_attention = True
    packed = TorchBackend(tiny_model_dir, train_config(attn_implementation="sdpa"))
    batches = micro_batches(10_000)[0]
    assert batches[0].num_sequences > 1
    torch.testing.assert_close(
        padded.forward_logprobs(batches), packed.forward_logprobs(batches), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        run_steps(padded, batches, 2), run_steps(packed, batches, 2), rtol=1e-5, atol=1e-6
    )


def test_varlen_attention_equals_the_masked_packed_row_forward_and_backward(
    tiny_model_dir: Path,
) -> None:
    """``attn_implementation: varlen`` (per-sequence causal attention from the boundaries, the
    flash varlen kernel on CUDA) computes what the block-diagonal mask computes."""
    varlen = TorchBackend(tiny_model_dir, train_config(attn_implementation="varlen"))
    assert varlen.model.varlen_attention
    packed = TorchBackend(tiny_model_dir, train_config(attn_implementation="sdpa"))
    batches = micro_batches(10_000)[0]
    assert batches[0].num_sequences > 1
    torch.testing.assert_close(
        varlen.forward_logprobs(batches), packed.forward_logprobs(batches), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        run_steps(varlen, batches, 2), run_steps(packed, batches, 2), rtol=1e-5, atol=1e-6
    )
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(
        varlen.forward_logprobs(probe), packed.forward_logprobs(probe), atol=1e-4, rtol=0
    )


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler on CPU")
def test_compiled_decoder_layers_train_like_the_eager_model(tiny_model_dir: Path) -> None:
    """``train.compile`` compiles the decoder layers and changes no number: logprobs and two
    steps over micro-batches of different lengths (dynamic shapes) match the eager model."""
    compiled = TorchBackend(tiny_model_dir, train_config(compile=True))
    layers = compiled.model.policy.get_decoder().layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    eager = TorchBackend(tiny_model_dir, train_config())
    batches = micro_batches(64)[0]
    assert len({b.num_tokens for b in batches}) > 1
    torch.testing.assert_close(
        compiled.forward_logprobs(batches), eager.forward_logprobs(batches), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        run_steps(compiled, batches, 2), run_steps(eager, batches, 2), rtol=1e-5, atol=1e-6
    )


def test_the_update_s_own_forward_gives_the_proximal_logprobs_of_a_separate_pass(
    tiny_model_dir: Path,
) -> None:
    """What lets the trainer skip the no-grad proximal pass: one optimizer update per step,
    so the proximal policy is the weights the update's forward runs."""
    separate = TorchBackend(tiny_model_dir, train_config())
    fused = TorchBackend(tiny_model_dir, train_config())
    batches, other = micro_batches(40)[0], micro_batches(40)[0]
    for mb, prox in zip(batches, separate.forward_logprobs(batches), strict=True):
        mb.proximal_logprobs = prox
    assert all(mb.proximal_logprobs is None for mb in other)
    a = separate.train_step(batches, loss_fn())
    b = fused.train_step(other, loss_fn())
    for key in ("loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7)
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(
        separate.forward_logprobs(probe), fused.forward_logprobs(probe), atol=1e-5, rtol=0
    )


def test_bf16_on_a_cpu_without_native_bf16_trains_in_float32(tiny_model_dir: Path, caplog) -> None:
    """``train.bf16`` autocasts only where bf16 products are native: on an AVX2-only CPU a
    bf16 matmul takes a scalar path tens of times slower than float32, which turned a
    minutes-long CPU run into hours."""
    from areal_sdk.backends.train.torch_backend import bf16_runs_fast

    with caplog.at_level("WARNING"):
        backend = TorchBackend(tiny_model_dir, train_config(bf16=True))
    native = bf16_runs_fast(torch.device("cpu"))
    assert backend.bf16 is native
    assert ("no native bfloat16" in caplog.text) is not native
    assert TorchBackend(tiny_model_dir, train_config(bf16=False)).bf16 is False
    batches = micro_batches(64)[0]
    assert all(torch.isfinite(lp).all() for lp in backend.forward_logprobs(batches))
