"""``areal-sdk serve``: engine + gateway in one process, started the way a user starts it."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import time

import pytest
from openai import OpenAI

from areal_sdk.cli import build_parser
from areal_sdk.cli.serve import DEFAULT_PORT, _settings


def test_flags_and_config_resolve(tmp_path):
    parser = build_parser()
    cfg = _settings(parser.parse_args(["serve", "--model", "/m", "--port", "9001"]))
    assert (cfg.model.path, cfg.inference.port, cfg.inference.host) == ("/m", 9001, "127.0.0.1")
    assert cfg.run.dir == "runs/serve"
    cfg = _settings(parser.parse_args(["serve", "--model", "/m"]))
    assert cfg.inference.port == DEFAULT_PORT
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /x\ninference:\n  port: 7000\nrun:\n  dir: /r\n")
    cfg = _settings(
        parser.parse_args(
            ["serve", str(config), "inference.max_model_len=512", "--host", "0.0.0.0"]
        )
    )
    assert (
        cfg.model.path,
        cfg.inference.port,
        cfg.inference.max_model_len,
        cfg.inference.host,
    ) == ("/x", 7000, 512, "0.0.0.0")
    assert cfg.run.dir == "runs/serve"  # the config's run.dir is a training run's
    cfg = _settings(parser.parse_args(["serve", str(config), "--run-dir", "/r"]))
    assert cfg.run.dir == "/r"
    with pytest.raises(ValueError):
        _settings(parser.parse_args(["serve"]))


@pytest.mark.skipif(
    "gateway" not in {ep.name for ep in md.entry_points(group="areal_sdk")},
    reason='entry point gateway = "areal_sdk.gateway.plugin" is not installed',
)
def test_serve_starts_engine_and_gateway(tiny_model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model:\n  path: {tiny_model_dir}\ninference:\n  port: 0\n  max_model_len: 512\n"
        f"run:\n  dir: {tmp_path / 'run'}\n"
    )
    env = {**os.environ, "AREAL_SDK_ADMIN_TOKEN": "serve-admin"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "serve", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = None
        deadline = time.monotonic() + 120
        while base is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("gateway:"):
                base = line.split()[1]
            assert "serve-admin" not in line  # a key from the environment is never echoed
        assert base is not None and base.startswith("http://127.0.0.1:")
        client = OpenAI(base_url=base + "/v1", api_key="serve-admin", max_retries=0)
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.choices[0].message.role == "assistant"
    finally:
        proc.terminate()
        proc.wait(30)


def _trained_checkpoint(model_dir, run_dir):
    """A run's checkpoint of the tiny model after a few big steps, and its trainer."""
    from areal_sdk.backends.train.torch_backend import TorchBackend

    from areal_sdk.checkpoints import Checkpoints
    from tests.backends.train.common import loss_fn, micro_batches, train_config

    backend = TorchBackend(model_dir, train_config())
    batches = micro_batches(40)[0]
    for k in range(3):
        backend.train_step(batches, loss_fn(k))
    return Checkpoints(run_dir).save(backend).path, backend


def _serve(*args, cwd):
    """``areal-sdk serve ARGS`` on a free port: the process, its gateway's base URL (None
    when it exited first) and what it printed until then."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "serve", *args, "--port", "0"],
        env={**os.environ, "AREAL_SDK_ADMIN_TOKEN": "serve-admin"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    printed = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        printed.append(line)
        if line.startswith("gateway:"):
            return proc, line.split()[1], "".join(printed)
    return proc, None, "".join(printed)


@pytest.mark.slow
def test_serve_model_checkpoint_serves_the_trained_weights(tiny_model_dir, tmp_path):
    import torch

    from tests.backends.train.common import single

    checkpoint, trainer = _trained_checkpoint(tiny_model_dir, tmp_path / "run")
    proc, base, _ = _serve(
        "--model", str(checkpoint), "--run-dir", str(tmp_path / "serve"), cwd=tmp_path
    )
    try:
        assert base is not None
        client = OpenAI(base_url=base + "/v1", api_key="serve-admin", max_retries=0)
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=8,
            temperature=1.0,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
    finally:
        proc.terminate()
        proc.wait(30)
    reply = r.model_dump()
    prompt, completion = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    served = torch.tensor([e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]])
    # The trainer's own logprobs of the served tokens: the engine runs the trained weights.
    ids = prompt + completion
    expected = trainer.forward_logprobs([single(ids)])[0][len(prompt) :]
    # OpenAI's logprobs leave out the end-of-turn token that token_ids keep, when one came.
    assert len(expected) - len(served) in (0, 1)
    torch.testing.assert_close(served, expected[: len(served)], atol=2e-3, rtol=0)
    from areal_sdk.backends.train.torch_backend import TorchBackend

    from tests.backends.train.common import train_config

    untrained = TorchBackend(tiny_model_dir, train_config()).forward_logprobs([single(ids)])[0]
    assert (untrained[len(prompt) :] - expected).abs().max() > 0.05


def test_serve_refuses_a_checkpoint_with_missing_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    checkpoint, _ = _trained_checkpoint(tiny_model_dir, tmp_path / "run")
    weights = load_file(checkpoint / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    proc, base, out = _serve(
        "--model", str(checkpoint), "--run-dir", str(tmp_path / "serve"), cwd=tmp_path
    )
    assert base is None and proc.wait(30) != 0
    lines = out.strip().splitlines()
    assert (
        lines[-1].startswith("error: ") and "1 missing (model.layers.1.mlp.down_proj" in lines[-1]
    )
    assert "Traceback" not in out and "LOAD REPORT" not in out
