from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K_DIR}")
    return GSM8K_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen2 with a trained byte-level BPE tokenizer and ChatML template."""
    from tests.tiny_model import build_tiny_model

    train = GSM8K_DIR / "train.jsonl"
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-model"), train if train.is_file() else None
    )
