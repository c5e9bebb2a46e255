"""``areal-sdk export``: a run's trained model alone, as a Hugging Face directory or GGUF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.train.torch_backend import TorchBackend
from gguf import GGUFReader

from areal_sdk.checkpoints import Checkpoints, read_weights
from areal_sdk.cli import main
from areal_sdk.gguf_export import write_gguf
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, train_config

CHAT = [{"role": "user", "content": "What is 12 + 30? Think <think> then answer."}]


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with the checkpoints of steps 1 and 2 of the tiny model."""
    run = tmp_path_factory.mktemp("run")
    backend = TorchBackend(tiny_model_dir, train_config())
    checkpoints = Checkpoints(run)
    batches = micro_batches(40)[0]
    for k in range(2):
        backend.train_step(batches, loss_fn(k))
        checkpoints.save(backend)
    return run


def cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exited:
        main(["export", *argv])
    return int(exited.value.code or 0)


def logits(model, ids=FIXED_SEQUENCE) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


def as_bf16(model):
    """The model as a bfloat16 GGUF holds it: matrices rounded to bfloat16, norms and biases
    float32 (as llama.cpp stores them); computing in float32."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(p.to(torch.bfloat16).float())
    return model


def test_export_writes_the_newest_checkpoint_as_a_bf16_model_alone(
    run_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli(str(run_dir), "-o", str(tmp_path / "model")) == 0
    out = tmp_path / "model"
    assert not (out / "optimizer").exists() and not (out / "train_state.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    newest = read_weights(run_dir / "checkpoints" / "step-2")
    exported = read_weights(out)
    assert exported.keys() == newest.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, newest[name].to(torch.bfloat16)), name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)

    # --step picks an older checkpoint.
    assert cli(str(run_dir), "--step", "1", "-o", str(tmp_path / "step1")) == 0
    older = read_weights(tmp_path / "step1")
    assert not torch.equal(older["model.norm.weight"], exported["model.norm.weight"])


def test_export_to_gguf_round_trips_through_transformers_gguf_loader(
    run_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli(str(run_dir), "--format", "gguf", "-o", str(tmp_path / "m.gguf")) == 0
    checkpoint = run_dir / "checkpoints" / "step-2"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    expected = as_bf16(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
    torch.testing.assert_close(logits(loaded), logits(expected), atol=1e-5, rtol=0)
    exact = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert cli(str(run_dir), "--format", "gguf", "--dtype", "float32", "-o", str(tmp_path)) == 0
    f32 = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32
    )
    torch.testing.assert_close(logits(f32), logits(exact), atol=1e-5, rtol=0)

    # What llama.cpp reads: architecture, tokenizer kind, types (checked against llama.cpp's
    # own conversion of SmolLM2: same tensor names and shapes, tokens, types and merges).
    reader = GGUFReader(tmp_path / "m.gguf")
    fields = {key: reader.fields[key].contents() for key in reader.fields}
    assert fields["general.architecture"] == "qwen2"
    assert fields["general.name"] == f"{run_dir.name}-step-2"
    # transformers reads a qwen2 directory's tokenizer with Qwen2's split regex.
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert (
        fields["tokenizer.chat_template"] == AutoTokenizer.from_pretrained(checkpoint).chat_template
    )
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == "BF16" and kinds["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in kinds  # tied to token_embd, as llama.cpp expects

    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    original = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    ) == original.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.eos_token == original.eos_token == "<|im_end|>"


def test_a_llama_model_s_gguf_carries_the_rotary_permutation(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """llama.cpp wants Llama's query and key rows interleaved; a reader undoes it, so the
    logits come back exactly (Qwen2 files keep HF's order)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    source = tmp_path / "llama"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, source / name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=347,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=100000.0,
    )
    LlamaForCausalLM(config).save_pretrained(source)
    write_gguf(source, tmp_path / "llama.gguf", dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="llama.gguf")
    reference = AutoModelForCausalLM.from_pretrained(source)
    assert loaded.config.model_type == "llama" and not loaded.config.tie_word_embeddings
    torch.testing.assert_close(logits(loaded), logits(reference), atol=1e-5, rtol=0)


def test_export_errors_are_one_line(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert cli(str(tmp_path), "-o", str(tmp_path / "out")) != 0
    assert "has no checkpoint" in capsys.readouterr().err
    assert cli(str(run_dir), "--step", "7", "-o", str(tmp_path / "out")) != 0
    assert "no checkpoint of step 7" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    assert cli(str(run_dir), "-o", str(tmp_path / "taken")) != 0
    err = capsys.readouterr().err
    assert "already exists" in err and "Traceback" not in err
    old = tmp_path / "old-run" / "checkpoints" / "step-1"  # before model directories
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text('{"step": 1, "version": 1}')
    assert cli(str(tmp_path / "old-run"), "-o", str(tmp_path / "out")) != 0
    assert "no model directory (no config.json)" in capsys.readouterr().err
