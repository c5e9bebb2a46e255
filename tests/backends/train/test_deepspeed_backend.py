"""DeepSpeed ZeRO 0/2/3 on CPU over gloo, as real processes, against the torch backend."""

from __future__ import annotations

import queue
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from areal_sdk.backends.train.torch_backend import TorchBackend

from tests.backends.train.common import (
    FIXED_SEQUENCE,
    loss_fn,
    micro_batches,
    single,
    train_config,
)
from tests.backends.train.ds_worker import run_rank

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(model_dir: Path, stage: int, world: int, ckpt: Path, lora: dict | None = None) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=run_rank, args=(r, world, port, str(model_dir), stage, str(ckpt), out, lora)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=240)
    except queue.Empty:
        result = {"error": "no result within 240 s"}
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert "error" not in result, result["error"]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result


@pytest.fixture(scope="module")
def torch_reference(tiny_model_dir: Path) -> dict:
    backend = TorchBackend(tiny_model_dir, train_config())
    batches = micro_batches(40)[0]
    losses = [backend.train_step(batches, loss_fn(k))["loss"] for k in range(4)]
    state = {n: tuple(t.shape) for b in backend.state_for_sync(64 * 1024) for n, t in b}
    probe = backend.forward_logprobs([single(FIXED_SEQUENCE)])[0]
    return {"losses": losses, "state": state, "probe": probe}


@pytest.mark.parametrize(("stage", "world"), [(0, 1), (2, 2), (3, 2)])
def test_deepspeed_matches_torch_and_resumes(
    tiny_model_dir: Path, tmp_path: Path, torch_reference: dict, stage: int, world: int
) -> None:
    got = run_job(tiny_model_dir, stage, world, tmp_path / "ckpt")
    assert got["zero_stage"] == stage and got["step"] == 4
    # Same losses step by step, whether one process holds everything or two ranks share it.
    torch.testing.assert_close(got["losses"], torch_reference["losses"], rtol=1e-4, atol=1e-6)
    # The weights synced out are every HF weight, gathered whole even under ZeRO-3.
    assert got["state"] == torch_reference["state"]
    torch.testing.assert_close(
        torch.tensor(got["probe"]), torch_reference["probe"], atol=1e-4, rtol=0
    )
    # The checkpoint is a Hugging Face model directory of every weight, ZeRO-3 included.
    assert got["checkpoint_state"] == torch_reference["state"]
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # Resuming from the step-2 checkpoint repeats steps 3 and 4 exactly.
    assert got["resumed_step"] == 2
    torch.testing.assert_close(got["resumed_losses"], got["losses"][2:], rtol=1e-6, atol=1e-8)


def test_deepspeed_zero3_trains_lora_adapters_as_the_torch_backend_does(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("peft")
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    reference = TorchBackend(tiny_model_dir, train_config(lora=lora))
    batches = micro_batches(40)[0]
    losses = [reference.train_step(batches, loss_fn(k))["loss"] for k in range(4)]
    state = {n: tuple(t.shape) for b in reference.state_for_sync(64 * 1024) for n, t in b}
    probe = reference.forward_logprobs([single(FIXED_SEQUENCE)])[0]

    got = run_job(tiny_model_dir, 3, 2, tmp_path / "ckpt", lora=lora)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-4, atol=1e-6)
    # The merged weights under the base model's names, gathered whole under ZeRO-3.
    assert got["state"] == state == got["checkpoint_state"]
    torch.testing.assert_close(torch.tensor(got["probe"]), probe, atol=1e-4, rtol=0)
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    # DeepSpeed's own checkpoint keeps the adapters and their optimizer state: resuming
    # repeats steps 3 and 4 exactly.
    assert got["resumed_step"] == 2
    torch.testing.assert_close(got["resumed_losses"], got["losses"][2:], rtol=1e-6, atol=1e-8)
