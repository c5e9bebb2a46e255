"""Flash decode attention over the slot cache (CUDA only: the flash kernel has no CPU build)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from areal_sdk.backends.embedded.kv_cache import flash_decode

from tests.backends.embedded.test_fused_decoder import _llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs CUDA")


def test_each_row_attends_over_its_own_slot_prefix_only() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    slots, kv_heads, heads, positions, dim = 8, 2, 14, 65, 64
    shape = (slots, kv_heads, positions, dim)
    keys = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(6, heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([1, 5, 64, 33, 17, 2], device="cuda")
    out = flash_decode(query, keys, values, lengths, 64, dim**-0.5).float()
    for r, n in enumerate(lengths.tolist()):
        k = keys[r, :, :n].float().repeat_interleave(heads // kv_heads, 0)
        v = values[r, :, :n].float().repeat_interleave(heads // kv_heads, 0)
        want = F.scaled_dot_product_attention(
            query[r].float().unsqueeze(1), k, v, scale=dim**-0.5
        ).squeeze(1)
        torch.testing.assert_close(out[r], want, atol=2e-2, rtol=2e-2)


def _bf16_llama(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


@pytest.mark.parametrize("fused", [False, True])
def test_decode_steps_with_flash_attention_give_the_masked_sdpa_logits(
    tmp_path: Path, fused: bool
) -> None:
    """The engine's decode steps (CUDA graphs, several cache buckets) with flash decode and,
    in the second case, the fused decoder with its compiled parts (the CUDA defaults), against
    the transformers layers with a masked SDPA."""
    from areal_sdk.backends.embedded.model_runner import ModelRunner, RowInput

    model_dir = _llama(tmp_path)
    reference = ModelRunner(
        _bf16_llama(model_dir), num_slots=4, max_len=300, flash_decode=False, fused_decoder=False
    )
    tried = ModelRunner(
        _bf16_llama(model_dir), num_slots=4, max_len=300, flash_decode=True, fused_decoder=fused
    )
    assert tried.flash_decode and (tried.fused is not None) is fused
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 40, 130, 200)]
    for runner in (reference, tried):
        runner.forward([RowInput(i, 0, p) for i, p in enumerate(prompts)])
    lengths = [len(p) for p in prompts]
    for step in range(8):
        tokens = [(7 * step + i) % 300 for i in range(4)]
        want = reference.decode([0, 1, 2, 3], lengths, tokens)
        got = tried.decode([0, 1, 2, 3], lengths, tokens)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
        lengths = [n + 1 for n in lengths]


def test_the_fused_decoder_captures_a_graph_for_every_width_and_cache_length(
    tmp_path: Path,
) -> None:
    """Every decode width and cache bucket of a 64-slot engine, and prefill besides: the
    compiled parts must not run out of dynamo's variants (capture failed past them, and the
    engine decoded eagerly at a tenth of the speed)."""
    from areal_sdk.backends.embedded.model_runner import ModelRunner, RowInput

    runner = ModelRunner(
        _bf16_llama(_llama(tmp_path)), num_slots=64, max_len=300, fused_decoder=True
    )
    assert runner.graph_error is None
    assert len(runner._graphs) == len(runner._graph_buckets) * len(runner._kv_buckets) > 20
    logits = runner.forward([RowInput(0, 0, list(range(1, 50))), RowInput(1, 0, [5])])
    assert torch.isfinite(logits).all()
