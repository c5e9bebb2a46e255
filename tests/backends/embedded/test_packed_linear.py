"""Prepacked CPU weights: the same logits as the plain model, repacked after a weight update
(tied head included), and out of the way of autograd."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded.engine import EmbeddedEngine
from areal_sdk.backends.embedded.packed_linear import PackedLinears, packed_linear_available
from areal_sdk.backends.embedded.weights import load_into

from areal_sdk.inference import SamplingParams

pytestmark = pytest.mark.skipif(
    not packed_linear_available(torch.device("cpu"), torch.float32),
    reason="this torch build has no oneDNN prepacked linear",
)


def _model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (3, 17), generator=torch.Generator().manual_seed(0))


def _assert_same_logits(packed: torch.nn.Module, plain: torch.nn.Module) -> None:
    with torch.inference_mode():
        torch.testing.assert_close(
            packed(_ids()).logits, plain(_ids()).logits, rtol=1e-5, atol=1e-5
        )


def test_packed_model_gives_the_plain_models_logits(tiny_model_dir: Path) -> None:
    plain, packed = _model(tiny_model_dir), _model(tiny_model_dir)
    linears = PackedLinears(packed)
    assert len(linears.linears) >= 7 * 2 + 1  # every projection of both layers, and the head
    _assert_same_logits(packed, plain)


def test_new_weights_reach_the_packed_copies_tied_head_included(tiny_model_dir: Path) -> None:
    packed = _model(tiny_model_dir)
    assert packed.config.tie_word_embeddings
    linears = PackedLinears(packed)
    # A trainer's state may name the tied matrix by its embedding's name only.
    g = torch.Generator().manual_seed(1)
    new = {
        name: torch.randn(p.shape, generator=g) * 0.05
        for name, p in packed.named_parameters()
        if name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight")
    }
    linears.repack(load_into(packed, new))
    reference = _model(tiny_model_dir)
    load_into(reference, new)
    _assert_same_logits(packed, reference)


def test_a_forward_that_records_gradients_takes_the_plain_path(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    PackedLinears(model)
    loss = model(_ids()).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_bf16_packed_logits_stay_within_bf16_rounding(tiny_model_dir: Path) -> None:
    if not packed_linear_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no native bf16 on this CPU")
    plain, packed = _model(tiny_model_dir, torch.bfloat16), _model(tiny_model_dir, torch.bfloat16)
    PackedLinears(packed)
    with torch.inference_mode():
        expected = plain(_ids()).logits.float()
        got = packed(_ids()).logits.float()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-2


async def test_a_closed_engine_leaves_the_model_as_it_came(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    engine = EmbeddedEngine(model)
    assert "forward" in vars(model.lm_head)  # packed while the engine runs
    await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
    await engine.close()
    assert not any("forward" in vars(m) or "_areal_packed" in vars(m) for m in model.modules())


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


async def test_the_engine_holds_each_weight_once_and_still_takes_updates(
    tiny_model_dir: Path,
) -> None:
    model, reference = _model(tiny_model_dir), _model(tiny_model_dir)
    engine = EmbeddedEngine(model)
    # Every projection's weight lives only in its packed (or stacked) copy; the embedding,
    # which the tied head shares, and the norms keep theirs.
    linears = {
        f"{name}.weight"
        for name, m in reference.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    }
    assert {name for name, p in model.named_parameters() if p.is_meta} == linears
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    assert (await engine.generate(prompt, greedy)).output_ids == _greedy(reference, prompt, 8)

    # A whole update (as the trainer pushes) and a partial one (one member of a stack).
    g = torch.Generator().manual_seed(3)
    noisy = {
        name: p.detach() + 0.5 * p.detach().std() * torch.randn(p.shape, generator=g)
        for name, p in reference.named_parameters()
    }
    partial = {
        "model.layers.1.self_attn.k_proj.weight": noisy.pop(
            "model.layers.1.self_attn.k_proj.weight"
        )
    }
    for version, update in enumerate((noisy, partial), start=1):
        await engine.update_weights(update, version)
        load_into(reference, update)
        assert (await engine.generate(prompt, greedy)).output_ids == _greedy(reference, prompt, 8)
    for name, value in engine.runner.weights().items():
        torch.testing.assert_close(value, dict(reference.named_parameters())[name].detach())

    await engine.close()  # the model gets its own weights back, updated
    for (name, got), (_, expected) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(got.detach(), expected.detach(), msg=name)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
async def test_the_engine_keeps_no_mapping_of_the_weights_file(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # transformers maps the safetensors file; a tensor left a view of it would keep the
    # whole file's pages resident beside the engine's packed copies.
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    engine = EmbeddedEngine.from_pretrained(str(model_dir), dtype="float32")
    try:
        assert str(model_dir / "model.safetensors") not in Path("/proc/self/maps").read_text()
        out = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
        assert len(out.output_ids) == 3
    finally:
        await engine.close()
