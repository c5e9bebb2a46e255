"""A checkpoint is the trained model as a Hugging Face directory, the trainer's state beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train.torch_backend import TorchBackend

from areal_sdk.checkpoints import OPTIMIZER_DIR, Checkpoints
from areal_sdk.models import WeightMismatchError
from tests.backends.train.common import (
    FIXED_SEQUENCE,
    loss_fn,
    micro_batches,
    single,
    train_config,
)


def trained(model_dir: Path, steps: int = 2) -> TorchBackend:
    backend = TorchBackend(model_dir, train_config())
    batches = micro_batches(40)[0]
    for k in range(steps):
        backend.train_step(batches, loss_fn(k))
    return backend


def test_from_pretrained_loads_the_trained_weights_tokenizer_and_chat_template(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = trained(tiny_model_dir)
    backend.save(tmp_path / "ckpt")

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded = dict(model.named_parameters())
    for name, param in backend.named_parameters():
        assert torch.equal(loaded[name], param.detach().cpu()), name
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(original.model.norm.weight, model.model.norm.weight)  # it trained
    # The loaded model computes what the trainer computes.
    ids = torch.tensor([FIXED_SEQUENCE])
    with torch.no_grad():
        logits = model.eval()(ids).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    got = backend.forward_logprobs([single(FIXED_SEQUENCE)])[0]
    torch.testing.assert_close(got[1:], expected, atol=1e-5, rtol=1e-5)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "float32"
    assert (tmp_path / "ckpt" / "generation_config.json").is_file()
    assert (tmp_path / "ckpt" / OPTIMIZER_DIR / "optimizer.pt").is_file()


def test_a_checkpoint_with_weights_missing_or_unexpected_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    backend = trained(tiny_model_dir, steps=1)
    backend.save(tmp_path / "ckpt")
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    weights["model.extra.weight"] = weights.pop("model.norm.weight")
    save_file(weights, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    fresh = TorchBackend(tiny_model_dir, train_config())
    with pytest.raises(WeightMismatchError, match=r"model\.norm\.weight.*model\.extra\.weight"):
        fresh.load(tmp_path / "ckpt")


def test_a_checkpoint_of_the_old_layout_still_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Before model directories, ``save`` wrote the wrapped model's tensors (``policy.``
    names) and ``optimizer.pt`` side by side, and no config.json."""
    from safetensors.torch import save_model

    batches = micro_batches(40)[0]
    first = trained(tiny_model_dir)
    old = tmp_path / "old"
    old.mkdir()
    save_model(first.model, str(old / "model.safetensors"))
    torch.save(first.optimizer.state_dict(), old / "optimizer.pt")
    (old / "train_state.json").write_text(json.dumps({"backend": "torch", "step": 2}))
    expected = first.train_step(batches, loss_fn(2))["loss"]

    resumed = TorchBackend(tiny_model_dir, train_config())
    resumed.load(old)
    assert resumed.step == 2
    assert resumed.train_step(batches, loss_fn(2))["loss"] == expected


def test_optimizer_state_is_kept_for_the_newest_checkpoint_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = trained(tiny_model_dir, steps=1)
    batches = micro_batches(40)[0]
    latest_only = Checkpoints(tmp_path / "a", keep=3)
    every = Checkpoints(tmp_path / "b", keep=3, keep_optimizer_state="all")
    for k in range(3):
        latest_only.save(backend)
        every.save(backend)
        backend.train_step(batches, loss_fn(1 + k))
    assert [(c.step, c.has_optimizer_state) for c in latest_only.all()] == [
        (1, False),
        (2, False),
        (3, True),
    ]
    assert all(c.has_optimizer_state for c in every.all())

    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    older, newest = latest_only.all()[0].path, latest_only.all()[-1].path
    assert size(older) < 0.5 * size(newest)  # AdamW keeps two float32 moments per weight

    # An older checkpoint is still the whole model; resuming from it says what is missing.
    shutil.copytree(older, tmp_path / "older")
    fresh = TorchBackend(tiny_model_dir, train_config())
    with pytest.raises(FileNotFoundError, match="no optimizer state"):
        fresh.load(tmp_path / "older")


def test_a_run_from_a_gguf_file_checkpoints_a_model_directory(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF model source is converted once (through transformers) for the trainer; its
    checkpoints carry the file's tokenizer, chat template and config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_sdk.config import Config
    from areal_sdk.gguf_export import write_gguf

    monkeypatch.setenv("AREAL_SDK_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf", dtype=torch.float32)
    config = Config.model_validate({"model": {"path": str(gguf)}, "train": {"lr": 1e-2}})
    backend = TorchBackend.from_config(config)
    engine_side = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    ids = torch.tensor([FIXED_SEQUENCE])
    with torch.no_grad():
        logits = engine_side.eval()(ids).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    got = backend.forward_logprobs([single(FIXED_SEQUENCE)])[0][1:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    backend.train_step(micro_batches(40)[0], loss_fn())
    backend.save(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert model.config.model_type == "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n")


def test_a_large_model_is_written_in_shards_that_from_pretrained_joins(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from areal_sdk.checkpoints import WEIGHTS_INDEX, ModelFiles, read_weights, write_weights

    backend = TorchBackend(tiny_model_dir, train_config())
    dtype = write_weights(backend.state_for_sync(64 * 1024), tmp_path)
    ModelFiles.from_source(tiny_model_dir).write(tmp_path, dtype)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert (tmp_path / WEIGHTS_INDEX).is_file() and not (tmp_path / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    weights = read_weights(tmp_path)
    for name, param in backend.named_parameters():
        assert torch.equal(weights[name], param.detach()), name
        assert torch.equal(model.get_parameter(name), param.detach()), name
