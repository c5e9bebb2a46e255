"""The backward recasts autocast's weight copies: the same gradients, no copies held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train import torch_backend, weight_casts
from areal_sdk.backends.train.torch_backend import TorchBackend

from tests.backends.train.common import loss_fn, micro_batches, train_config


@pytest.fixture
def kept(monkeypatch) -> list[torch.Tensor]:
    """The tensors the recasting hooks leave in the graph, as they pack them."""
    tensors: list[torch.Tensor] = []
    pack = weight_casts._pack

    def recording(tensor: torch.Tensor):
        packed = pack(tensor)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        return packed

    monkeypatch.setattr(weight_casts, "_pack", recording)
    return tensors


def test_the_graph_keeps_activations_but_no_bf16_weight_copy(kept) -> None:
    layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 8))
    x = torch.randn(2, 5, 64, requires_grad=True)
    grads = []
    for recast in (False, True):
        layer.zero_grad()
        kept.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if recast:
                with weight_casts.recast_weights_in_backward():
                    y = layer(x)
                shapes = {tuple(t.shape) for t in kept if t.dtype == torch.bfloat16}
                assert shapes and not shapes & {(256, 64), (64, 256), (8, 256), (256, 8)}
            else:
                y = layer(x)
        y.float().square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for plain, recast in zip(*grads, strict=True):
        assert torch.equal(plain, recast)  # the recast copy is the autocast copy, bit for bit


def test_a_bf16_step_on_cpu_trains_exactly_as_with_the_copies_kept(
    tiny_model_dir: Path, kept, monkeypatch
) -> None:
    # bf16 on this CPU even where its products are not native (slow, but the model is tiny):
    # what is tested is the recast, not the speed.
    monkeypatch.setattr(torch_backend, "bf16_runs_fast", lambda device: True)
    batches = micro_batches(40)[0]
    recast = TorchBackend(tiny_model_dir, train_config(bf16=True))
    assert recast.bf16
    with_recast = [recast.train_step(batches, loss_fn(k))["loss"] for k in range(2)]
    weights = {tuple(p.shape) for p in recast.model.parameters() if p.dim() == 2}
    kept_bf16 = {tuple(t.shape) for t in kept if t.dtype == torch.bfloat16}
    assert kept_bf16 and not kept_bf16 & (weights | {s[::-1] for s in weights})
    plain = TorchBackend(tiny_model_dir, train_config(bf16=True))
    monkeypatch.setattr(plain, "_keep_weights", torch_backend.contextlib.nullcontext)
    assert [plain.train_step(batches, loss_fn(k))["loss"] for k in range(2)] == with_recast
