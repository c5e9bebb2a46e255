"""varlen attention's padded cuDNN path: where the packed tokens go, when it is taken, and
that it computes what flash varlen computes."""

from __future__ import annotations

import pytest
import torch
from areal_sdk.backends.train import varlen_attention as va


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_padded_layout_places_each_token_in_its_row(monkeypatch) -> None:
    monkeypatch.setattr(va, "cudnn_available", lambda device: True)
    lengths = [3, 5, 4]
    index, batch, length = va.padded_layout(_cu(lengths), lengths, "cudnn")
    assert (batch, length) == (3, 5)
    assert index.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    # Sequences all of the longest length are the padded batch already.
    assert va.padded_layout(_cu([4, 4]), [4, 4], "auto") == (None, 2, 4)


def test_padded_layout_is_taken_only_where_padding_costs_little(monkeypatch) -> None:
    monkeypatch.setattr(va, "cudnn_available", lambda device: True)
    similar, skewed = [90, 100, 95], [10, 100, 20]
    assert va.padded_layout(_cu(similar), similar, "auto") is not None
    assert va.padded_layout(_cu(skewed), skewed, "auto") is None
    assert va.padded_layout(_cu(skewed), skewed, "cudnn") is not None
    assert va.padded_layout(_cu(similar), similar, "flash") is None


def test_padded_layout_stays_off_without_cudnn() -> None:
    lengths = [4, 4]
    assert va.padded_layout(_cu(lengths), lengths, "cudnn") is None  # CPU tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention needs CUDA")
@pytest.mark.parametrize("lengths", [[256, 256, 256], [200, 64, 256, 1, 130]])
def test_padded_cudnn_equals_flash_varlen(lengths: list[int]) -> None:
    torch.manual_seed(0)
    n, cu = sum(lengths), _cu(lengths).cuda()
    q, k, v = (
        torch.randn(n, heads, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for heads in (14, 2, 2)
    )
    grad = torch.randn(n, 14, 64, device="cuda", dtype=torch.bfloat16)
    layout = va.padded_layout(cu, lengths, "cudnn")
    assert layout is not None
    results = []
    for run in (
        lambda: va.flash_varlen(q, k, v, cu, max(lengths), 0.125),
        lambda: va.padded_cudnn(q, k, v, *layout, 0.125),
    ):
        out = run()
        (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), grad)
        results.append((out, dq, dk, dv))
    for got, want in zip(results[1], results[0], strict=True):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, err
