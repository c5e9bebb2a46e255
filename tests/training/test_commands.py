"""``areal-sdk train`` and ``areal-sdk rollout`` as a user runs them, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from areal_sdk.store import TrajectoryStore


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "areal_sdk", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_train_runs_evaluates_and_refuses_to_overwrite(run_config):
    config = run_config(run={"steps": 2})
    done = cli("train", config)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "held-out reward before:" in done.stdout and "held-out reward after:" in done.stdout
    assert "gain:" in done.stdout and "step 2/2" in done.stdout
    assert "4 held-out tasks x 1 sample = 4 episodes" in done.stdout
    assert "(standard error, 4 episodes, 0 failed)" in done.stdout
    run_dir = config.parent / "run"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((run_dir / "eval.json").read_text())["after"]["episodes"] == 4
    again = cli("train", config)
    assert again.returncode == 2 and "--resume" in again.stderr


def test_train_names_a_bad_config_key(run_config):
    done = cli("train", run_config(), "rollout.batch_size=3")
    assert done.returncode == 2
    assert "rollout" in done.stderr and "multiple of rollout.group_size" in done.stderr


def test_rollout_stores_episodes_and_prints_the_reward(run_config):
    config = run_config()
    done = cli("rollout", config, "data.limit=3")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "6 episodes (0 failed)" in done.stdout and "reward " in done.stdout
    with TrajectoryStore(config.parent / "run") as store:
        episodes = store.query(run_id="rollout")
    assert len(episodes) == 6 and all(e.turns for e in episodes)


def test_train_names_a_missing_agent_module_before_loading_anything(run_config):
    done = cli("train", run_config(), "agent.entry=no_such_agent:solve")
    assert done.returncode == 2
    assert "cannot find agent module 'no_such_agent'" in done.stderr
    assert "starting the engine" not in done.stdout


@pytest.mark.slow
def test_train_says_the_first_step_compiles_and_what_it_took(run_config):
    """``train.compile`` (the default on CUDA) costs the first step tens of seconds: the run
    says so before it, and after it how long the step took."""
    config = run_config(run={"steps": 1}, train={"compile": True}, eval={"before": False})
    done = cli("train", config, "eval.after=false")
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    before = out.index("the first training step compiles the trainer's decoder layers")
    after = out.index("first training step: ")
    assert before < after and "the compile included" in out[after:]
