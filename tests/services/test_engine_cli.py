"""``areal-sdk engine`` as a fleet starts it: a weight version and a name from the command
line, and a clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from areal_sdk.backends.sglang.launcher import _free_port


@pytest.mark.slow
def test_engine_serves_its_weight_version_and_exits_0_on_sigterm(tiny_model_dir: Path) -> None:
    port = _free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "engine", "--model", str(tiny_model_dir),
         "--port", str(port), "--max-batch-size", "2", "--max-model-len", "128",
         "--weight-version", "5", "--served-model-name", "policy"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            assert engine.poll() is None, engine.stderr.read()
            try:
                info = httpx.get(url + "/get_model_info", timeout=5).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the engine did not come up"
                time.sleep(0.3)
        assert info["weight_version"] == "5" and info["served_model_name"] == "policy"
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(30) == 0
        assert "Traceback" not in engine.stderr.read()
        # What a service log shows of the start: the model loading, then how long it took.
        out = engine.stdout.read()
        assert f"loading {tiny_model_dir} on cpu" in out and "loaded in " in out, out
    finally:
        engine.kill()
        engine.wait(10)


def test_a_negative_weight_version_is_one_error_line(tiny_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "areal_sdk", "engine", "--model", str(tiny_model_dir),
         "--weight-version", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --weight-version must be >= 0, got -1"]


@pytest.mark.slow
def test_engine_exits_when_its_lifeline_is_cut(tiny_model_dir: Path) -> None:
    """A fleet's server never outlives the fleet: closing the lifeline is what the kernel does
    when the run dies, however it dies."""
    from areal_sdk.services.lifeline import Lifeline

    port = _free_port("127.0.0.1")
    line = Lifeline()
    engine = subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "engine", "--model", str(tiny_model_dir),
         "--port", str(port), "--max-batch-size", "2", "--max-model-len", "128",
         "--lifeline", str(line.child_fd)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        pass_fds=(line.child_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    line.spawned()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert engine.poll() is None, engine.stderr.read()
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the engine did not come up"
                time.sleep(0.3)
        line.close()
        assert engine.wait(timeout=15) == 1
        assert "the parent process is gone" in engine.stderr.read()
    finally:
        line.close()
        engine.kill()
        engine.wait(10)
