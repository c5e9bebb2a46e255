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
