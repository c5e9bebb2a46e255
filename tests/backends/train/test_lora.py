"""LoRA training (``train.lora``) on the tiny model: what trains, what the engine serves after
a push, what a checkpoint holds, and a whole ``areal-sdk train`` run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded.engine import EmbeddedEngine
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync.in_process import InProcessSync

from areal_sdk.config import ConfigError, LoraConfig
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single, train_config
from tests.training.conftest import write_run

pytest.importorskip("peft")


def lora_backend(model_dir: Path, **lora: object) -> TorchBackend:
    return TorchBackend(model_dir, train_config(lora=LoraConfig(r=4, **lora)))


def weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logprob of each token of ``ids`` after the first, from an HF model's logits."""
    tokens = torch.tensor(ids)
    with torch.no_grad():
        logits = model(tokens[None]).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None]).squeeze(-1)


def merged_reference(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """PEFT's own merge: the base model, the adapter loaded on it, merged and unloaded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def test_a_lora_step_trains_the_adapters_and_leaves_the_base_alone(tiny_model_dir: Path) -> None:
    backend = lora_backend(tiny_model_dir)
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    names = {id(p): n for n, p in backend.model.named_parameters()}
    assert optimized and all(".lora_" in names[i] for i in optimized)
    assert len(optimized) == sum(".lora_" in n for n in names.values())
    before = weights(backend)
    batches = micro_batches(10_000)[0]
    probe = [single(FIXED_SEQUENCE)]
    logprobs_before = backend.forward_logprobs(probe)[0]
    for _ in range(2):
        assert backend.train_step(batches, loss_fn(backend.step))["skipped"] == 0.0
    after = weights(backend)
    adapters = [n for n in before if ".lora_" in n]
    base = [n for n in before if ".lora_" not in n]
    assert all(not torch.equal(before[n], after[n]) for n in adapters if ".lora_B" in n)
    assert all(torch.equal(before[n], after[n]) for n in base)
    assert not torch.allclose(backend.forward_logprobs(probe)[0], logprobs_before)


def test_bad_target_modules_are_one_config_error_naming_the_layers(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        lora_backend(tiny_model_dir, target_modules=["q_proj", "attention_dense"])
    message = str(caught.value)
    assert "train.lora.target_modules" in message and "attention_dense" in message
    assert "q_proj" in message.split("linear layers are:")[1]  # what the model does have
    for pattern in (r".*\.attention_dense", "q_proj("):  # matches nothing; not a regex
        with pytest.raises(ConfigError, match="train.lora.target_modules"):
            lora_backend(tiny_model_dir, target_modules=pattern)


async def test_after_a_push_the_engine_scores_like_the_merged_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = lora_backend(tiny_model_dir, target_modules=["q_proj", "v_proj", "down_proj"])
    batches = micro_batches(10_000)[0]
    for _ in range(3):
        backend.train_step(batches, loss_fn(backend.step))
    engine = EmbeddedEngine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32")
    try:
        await InProcessSync(engine, timeout_s=30).push(backend.state_for_sync(32 << 10), 3)
        served = torch.tensor([x or 0.0 for x in await engine.score(FIXED_SEQUENCE)])
    finally:
        await engine.close()
    merged = merged_reference(tiny_model_dir, backend.save_adapter(tmp_path / "adapter"))
    expected = reference_logprobs(merged, FIXED_SEQUENCE)
    torch.testing.assert_close(served[1:], expected, atol=1e-4, rtol=0)
    # The adapters moved the policy: the base model alone scores differently.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert not torch.allclose(reference_logprobs(base, FIXED_SEQUENCE), expected, atol=1e-4)


def test_a_checkpoint_holds_the_adapter_and_the_merged_model_and_resumes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    backend = lora_backend(tiny_model_dir)
    batches = micro_batches(10_000)[0]
    for _ in range(2):
        backend.train_step(batches, loss_fn(backend.step))
    backend.save(tmp_path / "ckpt")
    adapter = tmp_path / "ckpt" / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    # The adapter on the base, through PEFT, computes what the checkpoint's merged model does.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids = torch.tensor([FIXED_SEQUENCE])
    with torch.no_grad():
        torch.testing.assert_close(
            merged_reference(tiny_model_dir, adapter)(ids).logits,
            merged(ids).logits,
            atol=1e-5,
            rtol=1e-5,
        )
    # Resumed, the adapter and its optimizer state continue the run exactly.
    resumed = lora_backend(tiny_model_dir)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(resumed.forward_logprobs(probe), backend.forward_logprobs(probe))
    loss_on = backend.train_step(batches, loss_fn(2))["loss"]
    assert resumed.train_step(batches, loss_fn(2))["loss"] == pytest.approx(loss_on, rel=1e-5)
    torch.testing.assert_close(resumed.forward_logprobs(probe), backend.forward_logprobs(probe))
    # A checkpoint of adapters does not resume a run of every weight.
    with pytest.raises(ValueError, match="trained LoRA adapters"):
        TorchBackend(tiny_model_dir, train_config()).load(tmp_path / "ckpt")


def areal_sdk(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_sdk", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_areal_sdk_train_with_lora_runs_and_checkpoints_an_adapter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = write_run(tmp_path, tiny_model_dir, run={"steps": 2})
    done = areal_sdk("train", str(config), "train.lora.r=4", "eval.before=false")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (checkpoint,) = (tmp_path / "run" / "checkpoints").iterdir()
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    assert (checkpoint / "model.safetensors").is_file()
    bad = areal_sdk(
        "train", str(config), "run.dir=" + str(tmp_path / "bad"), "train.lora.target_modules=[nope]"
    )
    assert bad.returncode != 0
    errors = [line for line in bad.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("error: train.lora.target_modules"), bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
