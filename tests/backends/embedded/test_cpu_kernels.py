"""The CPU decode-attention kernel: equal to SDPA over each row's own slot prefix, for every
grouping and head size (the AVX-512 routines and the generic loop), and strict on bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from areal_sdk.backends.embedded import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the kernel could not be built here (no compiler)"
)


def _reference(q, k_cache, v_cache, slots, lengths, scale):  # type: ignore[no-untyped-def]
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    out = []
    for r in range(rows):
        n = int(lengths[r])
        k = k_cache[slots[r], :, :n].float()
        v = v_cache[slots[r], :, :n].float()
        query = q[r].float().view(kv_heads, heads // kv_heads, dim)
        out.append(F.scaled_dot_product_attention(query, k, v, scale=scale).reshape(heads, dim))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (8, 8, 128), (4, 2, 16), (12, 1, 96)]
)
def test_kernel_equals_attention_over_each_rows_prefix(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    g = torch.Generator().manual_seed(heads * dim)
    num_slots, cache_len, rows = 6, 40, 5
    k_cache = torch.randn(num_slots, kv_heads, cache_len, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, cache_len, dim, generator=g).to(dtype)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 5, 1, 2])  # rows read slots out of order
    lengths = torch.tensor([1, cache_len, 17, 2, 33])  # one position, the whole cache, between
    scale = dim**-0.5
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, scale)
    expected = _reference(q, k_cache, v_cache, slots, lengths, scale)
    assert got.dtype == dtype and got.shape == (rows, heads, dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def test_large_scores_do_not_overflow() -> None:
    k_cache = torch.full((1, 1, 8, 64), 30.0)
    v_cache = torch.arange(8.0).view(1, 1, 8, 1).expand(1, 1, 8, 64).contiguous()
    q = torch.full((1, 1, 64), 30.0)
    q[0, 0, 0] = 31.0  # every score ~57,600: exp() would overflow without the max
    got = cpu_kernels.decode_attention(
        q, k_cache, v_cache, torch.tensor([0]), torch.tensor([8]), 1.0
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.full((1, 1, 64), 3.5))


def test_bad_inputs_raise_naming_the_problem() -> None:
    k = torch.zeros(2, 1, 8, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([0]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([2]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.decode_attention(q.double(), k, k, torch.tensor([0]), torch.tensor([1]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_and_normalises_as_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(3, 5, 96, generator=g) * 3).to(dtype)
    delta = torch.randn(3, 5, 96, generator=g).to(dtype)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    expected_sum = hidden + delta
    with torch.inference_mode():
        expected = norm(expected_sum)
    got = cpu_kernels.add_rms_norm(hidden, delta, norm.weight.detach(), 1e-5)
    assert torch.equal(hidden, expected_sum)  # the residual stream, updated in place
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: at most one unit in the last place
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    alone = cpu_kernels.add_rms_norm(expected_sum.clone(), None, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(alone, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 37])  # whole vector lanes, and a remainder
def test_silu_mul_equals_the_mlp_activation(dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(4, 3, 2 * width, generator=g) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = cpu_kernels.silu_mul(gate_up)
    assert got.shape == (4, 3, width) and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)  # rounded where transformers rounds
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_rotates_as_transformers_and_fills_the_cache(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, dim, rows, tokens = 6, 2, 64, 2, 3
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(rows, tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(rows, tokens, dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    k_cache = torch.zeros(4, kv_heads, 10, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([[2, 2, 2], [0, 0, 0]])
    positions = torch.tensor([[5, 6, 7], [0, 1, 9]])
    query = cpu_kernels.rope_write(qkv, cos, sin, k_cache, v_cache, slots, positions, heads)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q = q.view(rows, tokens, heads, dim).transpose(1, 2)
    k = k.view(rows, tokens, kv_heads, dim).transpose(1, 2)
    q_expected, k_expected = apply_rotary_pos_emb(q, k, cos, sin)
    # bf16: bit for bit (each product rounded where torch rounds); float32: fused multiply-adds
    # may differ in the last bit.
    same = torch.equal if dtype == torch.bfloat16 else _close
    assert same(query, q_expected.transpose(1, 2))
    for r in range(rows):
        for t in range(tokens):
            slot, pos = int(slots[r, t]), int(positions[r, t])
            assert same(k_cache[slot, :, pos], k_expected[r, :, t])
            assert torch.equal(v_cache[slot, :, pos], v.view(rows, tokens, kv_heads, dim)[r, t])
    assert int((k_cache != 0).any(-1).sum()) == rows * tokens * kv_heads  # nothing else written


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
