"""Flash decode attention over the slot cache (CUDA only: the flash kernel has no CPU build)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from areal_sdk.backends.embedded.kv_cache import flash_decode

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
