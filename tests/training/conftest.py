"""A run directory with a config and a small OpenAI-SDK agent, for whole-loop tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

AGENT = """
import areal_sdk as areal
from openai import AsyncOpenAI


@areal.trace
async def solve(task):
    client = AsyncOpenAI()
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=6,
    )
    text = reply.choices[0].message.content or ""
    # Any reward that differs within a group gives the trainer a gradient.
    return float(len(text) % 3 == 0)
"""


def write_run(tmp_path: Path, model_dir: Path, **sections: dict) -> Path:
    """Write toy_agent.py, tasks and config.yaml into ``tmp_path``; returns the config path."""
    (tmp_path / "toy_agent.py").write_text(AGENT)
    with (tmp_path / "tasks.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"t{i}", "question": f"What is {i} + {i}?"}) + "\n")
    config = {
        "model": {"path": str(model_dir)},
        "agent": {"entry": "toy_agent:solve"},
        "data": {"path": "tasks.jsonl", "eval_path": "tasks.jsonl", "eval_limit": 4},
        "rollout": {"group_size": 2, "batch_size": 4, "concurrency": 8, "max_staleness": 1},
        "inference": {"device": "cpu", "max_new_tokens": 6, "max_model_len": 256},
        "train": {"device": "cpu", "lr": 1e-4, "micro_batch_tokens": 256},
        "run": {"dir": str(tmp_path / "run"), "steps": 3, "metric_sinks": ["jsonl"]},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def run_config(tmp_path, tiny_model_dir):
    def make(**sections: dict) -> Path:
        return write_run(tmp_path, tiny_model_dir, **sections)

    return make


def train_subprocess(config: Path, *args: str) -> subprocess.Popen[str]:
    """``areal-sdk train CONFIG ARGS`` as a user runs it, its output unbuffered and merged."""
    return subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "train", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
