"""The train settings a user leaves unset: chosen for the device (backends/train/defaults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train.defaults import (
    CPU_MICRO_BATCH_TOKENS,
    MIN_AUTO_TOKENS,
    compile_by_default,
    engine_shares_device,
    micro_batch_tokens_for,
)
from areal_sdk.backends.train.torch_backend import TorchBackend, use_bf16

from areal_sdk.config import load_config
from tests.backends.train.common import train_config

GIB = 1 << 30
CUDA = torch.device("cuda")


def qwen_half_b(**overrides: int) -> torch.nn.Module:
    """The Qwen2-0.5B shape the benchmarks train, on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    shape.update(overrides)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(Qwen2Config(**shape))


def tokens(model: torch.nn.Module, gib: float, **kw: bool) -> int:
    kw = {"compiled": True, "checkpointing": False, "shares_device": False, **kw}
    return micro_batch_tokens_for(model, CUDA, device_bytes=int(gib * GIB), **kw)


def test_cuda_compiles_and_trains_in_bf16_by_default_and_a_cpu_does_neither() -> None:
    assert compile_by_default(None, CUDA) and not compile_by_default(None, torch.device("cpu"))
    assert use_bf16(None, CUDA) and not use_bf16(None, torch.device("cpu"))
    # What the user sets wins.
    assert not compile_by_default(False, CUDA) and compile_by_default(True, torch.device("cpu"))
    assert not use_bf16(False, CUDA)
    cfg = load_config(None, [])
    assert cfg.train.compile is None and cfg.train.bf16 is None
    assert cfg.train.micro_batch_tokens is None


def test_an_h100_takes_the_benchmark_step_as_one_micro_batch_and_less_when_shared() -> None:
    model = qwen_half_b()
    alone, shared = tokens(model, 79.1), tokens(model, 79.1, shares_device=True)
    # 16 x 2048 tokens in one micro-batch: the measured fast setting (benchmarks/README.md).
    assert alone >= 32768
    # Beside an engine on the same card: the 0.5B step of the end-to-end benchmark (64
    # episodes of a few hundred tokens) still fits in one.
    assert 16384 <= shared < alone
    assert tokens(model, 24.0) < alone
    assert tokens(model, 79.1, compiled=False) < alone  # uncompiled layers keep more
    assert tokens(model, 79.1, checkpointing=True) > alone
    # The stored-softmax head keeps a bf16 vocabulary row per token (0.3 MB at 152k).
    assert tokens(model, 79.1, stored_softmax=True) < alone
    assert alone % 1024 == 0 and shared % 1024 == 0


def test_a_model_that_fills_the_card_gets_the_smallest_micro_batch() -> None:
    big = qwen_half_b(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32)
    assert tokens(big, 24.0) == MIN_AUTO_TOKENS


def test_a_cpu_keeps_the_measured_size() -> None:
    model = qwen_half_b()
    sized = micro_batch_tokens_for(
        model, torch.device("cpu"), compiled=False, checkpointing=False, shares_device=False
    )
    assert sized == CPU_MICRO_BATCH_TOKENS


@pytest.mark.parametrize(
    ("overrides", "shares"),
    [
        (["inference.device=cuda", "train.device=cuda"], True),
        (["inference.device=cuda:0", "train.device=cuda"], True),
        (["inference.device=cuda:1", "train.device=cuda:0"], False),
        (["inference.device=cpu", "train.device=cuda"], False),
        (["inference.device=cpu", "train.device=cpu"], False),
        (
            [
                "inference.backend=sglang",
                "inference.urls=[http://10.0.0.2:30000]",
                "inference.device=cuda",
                "train.device=cuda",
            ],
            False,
        ),
    ],
)
def test_whether_the_engine_shares_the_trainers_card(overrides: list[str], shares: bool) -> None:
    assert engine_shares_device(load_config(None, overrides)) is shares


def test_the_backend_reports_the_micro_batch_it_packs(tiny_model_dir: Path) -> None:
    assert TorchBackend(tiny_model_dir, train_config()).micro_batch_tokens == CPU_MICRO_BATCH_TOKENS
    set_ = TorchBackend(tiny_model_dir, train_config(micro_batch_tokens=512))
    assert set_.micro_batch_tokens == 512
