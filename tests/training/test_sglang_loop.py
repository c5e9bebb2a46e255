"""The training loop with the engine in its own process: ``areal-sdk engine`` serving SGLang's
routes, the ``sglang`` inference backend attached to it by URL, weights pushed from disk."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import httpx

from areal_sdk.config import load_config
from areal_sdk.store import TrajectoryStore
from areal_sdk.training_run import TrainingRun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_training_against_an_engine_process_over_the_sglang_protocol(run_config, tiny_model_dir):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_sdk",
            "engine",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert engine.poll() is None, engine.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the engine did not come up"
            time.sleep(0.2)
        config = run_config(
            inference={"backend": "sglang", "urls": [url]},
            weights={"method": "disk", "pause_mode": "abort"},
            rollout={"max_staleness": 0},  # step 1 trains only what version 1 sampled
            run={"steps": 2},
            eval={"before": False},
        )
        cfg = load_config(config)
        result = asyncio.run(TrainingRun(cfg, config_dir=config.parent).run())
        assert result.steps == 2 and result.after is not None
        # The engine process serves the pushed weights, and tokens carry their versions.
        assert httpx.get(url + "/get_weight_version").json()["weight_version"] == "2"
        store = TrajectoryStore(cfg.run.dir)
        for step in (0, 1):
            trained = store.query(run_id="train", step=step)
            assert {v for e in trained for t in e.turns for v in t.versions} == {step}
        assert {
            v for e in store.query(run_id="eval-trained") for t in e.turns for v in t.versions
        } == {2}
    finally:
        engine.terminate()
        engine.wait(30)
