"""Packed prefill (every new token of a step in one row, sequence boundaries instead of a
padded batch and a mask) against the padded rows, and both against the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded.model_runner import ModelRunner, RowInput

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _prefill_in_chunks(runner: ModelRunner, sequences: list[list[int]], split: list[int]):
    """First ``split[i]`` tokens of each sequence in one step, the rest in a second step (one
    row starts fresh in the second step); returns the second step's logits."""
    first = [RowInput(i, 0, seq[: split[i]]) for i, seq in enumerate(sequences) if split[i]]
    runner.forward(first)
    rows = [RowInput(i, split[i], seq[split[i] :]) for i, seq in enumerate(sequences)]
    return runner.forward(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_prefill_gives_the_padded_rows_logits_and_the_models(
    tiny_model_dir: Path, device: str
) -> None:
    # Half precision on CUDA (the flash kernel's dtypes); float32 on CPU, tight.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _model(tiny_model_dir, device, dtype)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 23, 5, 40)]
    split = [4, 0, 2, 31]  # a cached prefix of 4, none, 2 and 31 tokens
    # A runner on CPU takes its model's weights into its packed copies: one model each.
    packed = ModelRunner(
        _model(tiny_model_dir, device, dtype),
        num_slots=4,
        max_len=64,
        cuda_graphs=False,
        packed_prefill=True,
    )
    padded = ModelRunner(
        _model(tiny_model_dir, device, dtype),
        num_slots=4,
        max_len=64,
        cuda_graphs=False,
        packed_prefill=False,
    )
    assert packed.packed_prefill and not padded.packed_prefill
    got = _prefill_in_chunks(packed, sequences, split)
    want = _prefill_in_chunks(padded, sequences, split)
    tol = {"atol": 5e-2, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 0}
    torch.testing.assert_close(got, want, **tol)
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            full = model(torch.tensor([seq], device=device)).logits[0, -1].float()
            torch.testing.assert_close(got[i], full, **tol)
    # The cache the packed steps wrote serves decoding: the next token's logits agree.
    nxt = [[7] for _ in sequences]
    positions = [len(s) for s in sequences]
    torch.testing.assert_close(
        packed.decode([0, 1, 2, 3], positions, [t[0] for t in nxt]),
        padded.decode([0, 1, 2, 3], positions, [t[0] for t in nxt]),
        **tol,
    )
