"""The fused Llama-family forward: which models take it, the HF model's logits through prefill
and decode steps, and new weights reaching the fused products."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded import fused_decoder
from areal_sdk.backends.embedded.model_runner import ModelRunner, RowInput
from areal_sdk.backends.embedded.weights import load_into


def _model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _llama(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def _steps(
    runner: ModelRunner, prompts: list[list[int]], new: list[list[int]]
) -> list[torch.Tensor]:
    """A prefill of ``prompts`` then one decode step per column of ``new``; every step's logits."""
    out = [runner.forward([RowInput(i, 0, p) for i, p in enumerate(prompts)])]
    lengths = [len(p) for p in prompts]
    for column in zip(*new, strict=True):
        out.append(runner.decode(list(range(len(prompts))), lengths, list(column)))
        lengths = [n + 1 for n in lengths]
    return out


def _full_forward(
    model: torch.nn.Module, prompts: list[list[int]], new: list[list[int]]
) -> list[torch.Tensor]:
    """The same logits from a plain HF forward over each whole sequence."""
    rows = []
    with torch.inference_mode():
        for p, n in zip(prompts, new, strict=True):
            logits = model(torch.tensor([p + n])).logits[0]
            rows.append(logits[len(p) - 1 : len(p) + len(n)])
    return [torch.stack([r[i] for r in rows]) for i in range(len(new[0]) + 1)]


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_runner_matches_the_hf_forward_through_prefill_and_decode(
    family: str, kernels: bool, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = tiny_model_dir if family == "qwen2" else _llama(tmp_path)
    model = _model(path)
    assert fused_decoder.supports(model)
    runner = ModelRunner(model, num_slots=4, max_len=64, fused_decoder=True)
    assert runner.fused is not None
    if not kernels:  # the path taken where the CPU kernels cannot be built
        runner._cpu_kernels = False  # decode attention through SDPA
        runner.fused._rope_write = False
        runner.fused._add_rms_norm = fused_decoder._add_rms_norm
        runner.fused._silu_mul = fused_decoder._silu_mul
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (5, 11, 1)]
    new = [torch.randint(3, 290, (4,), generator=g).tolist() for _ in prompts]
    got = _steps(runner, prompts, new)
    expected = _full_forward(_model(path), prompts, new)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_new_weights_reach_the_fused_products(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    runner = ModelRunner(model, num_slots=2, max_len=32, fused_decoder=True)
    g = torch.Generator().manual_seed(2)
    new = {
        name: torch.randn(p.shape, generator=g) * 0.1
        for name, p in model.named_parameters()
        if name.startswith("model.layers.1.") and name.endswith(("k_proj.bias", "up_proj.weight"))
    }
    assert len(new) == 2
    runner.load_weights(new)
    reference = _model(tiny_model_dir)
    load_into(reference, new)
    prompt = [5, 9, 13, 2, 40]
    got = runner.forward([RowInput(0, 0, prompt)])
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_models_with_other_layers_keep_their_own_modules(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config).eval()  # q_norm / k_norm: mathematics the fused path lacks
    assert not fused_decoder.supports(model)
    assert ModelRunner(model, num_slots=2, max_len=16).fused is None


@pytest.mark.parametrize("whole", [True, False], ids=["every-weight", "some-weights"])
def test_updates_write_into_the_stacks_the_decode_graphs_read(
    whole: bool, tiny_model_dir: Path
) -> None:
    # CUDA graphs replay the addresses they were captured with: an update that gave a stack
    # new storage would leave every later decode step on the old weights.
    model = _model(tiny_model_dir)
    runner = ModelRunner(model, num_slots=2, max_len=32, fused_decoder=True, packed_weights=False)
    assert runner.fused is not None
    stacks = runner.fused.stacks
    before = [
        (s.weight.data_ptr(), s.bias.data_ptr() if s.bias is not None else None) for s in stacks
    ]
    assert any(b is not None for _, b in before)  # qwen2: q, k and v have biases
    reference = _model(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    new = {
        name: p.detach() + torch.randn(p.shape, generator=g) * 0.05
        for name, p in reference.named_parameters()
        if whole or name.endswith(("k_proj.bias", "v_proj.weight", "up_proj.weight"))
    }
    runner.load_weights(new)
    after = [
        (s.weight.data_ptr(), s.bias.data_ptr() if s.bias is not None else None) for s in stacks
    ]
    assert after == before
    load_into(reference, new)
    prompts = [[5, 9, 13, 2, 40], [7, 7, 3]]
    got = _steps(runner, prompts, [[11, 12], [13, 14]])
    expected = _full_forward(reference, prompts, [[11, 12], [13, 14]])
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
