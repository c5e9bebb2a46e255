"""The ``areal-sdk`` command as a user runs it: a real subprocess."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from areal_sdk.store import TrajectoryStore
from areal_sdk.trajectory import Episode, EpisodeStatus
from tests.training.conftest import write_run


def cli(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "areal_sdk", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_help_lists_only_shipped_commands():
    out = cli("--help").stdout
    for command in ("plugins", "config", "trajectories"):
        assert command in out
    assert cli("config", "show", "--help").stdout.count("KEY=VALUE") >= 1
    assert "--format" in cli("trajectories", "export", "--help").stdout
    assert cli(check=False).returncode == 2  # no command: usage, not a crash


def test_plugins_table_and_json():
    rows = {r["name"]: r for r in json.loads(cli("plugins", "--json").stdout)}
    assert rows["builtin_rewards"]["usable"] is True
    assert "reward" in rows["builtin_rewards"]["kind"]
    assert rows["builtin_rewards"]["source"].startswith("areal-sdk ")
    table = cli("plugins").stdout
    assert "builtin_rewards" in table and "usable" in table


def test_plugins_disable_env(monkeypatch):
    monkeypatch.setenv("AREAL_SDK_DISABLE_PLUGINS", "builtin_rewards")
    rows = {r["name"]: r for r in json.loads(cli("plugins", "--json").stdout)}
    assert rows["builtin_rewards"]["usable"] is False
    assert "disabled" in rows["builtin_rewards"]["reason"]


def test_config_show_resolves_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_size: 2\n")
    out = cli(
        "config",
        "show",
        str(path),
        "rollout.group_size=6",
        "rollout.batch_size=12",
        "train.lr=2e-6",
    ).stdout
    assert "group_size: 6" in out and "lr: 2.0e-06" in out and "max_staleness: 1" in out
    shown = json.loads(cli("config", "show", str(path), "--json").stdout)
    assert shown["rollout"]["group_size"] == 2
    # Overrides may follow the flags, as in `train CONFIG --resume run.steps=32`.
    shown = json.loads(cli("config", "show", str(path), "--json", "rollout.group_size=4").stdout)
    assert shown["rollout"]["group_size"] == 4
    stray = cli("config", "show", str(path), "--json", "--bogus", check=False)
    assert stray.returncode == 2 and "unrecognized arguments: --bogus" in stray.stderr


def test_config_show_bad_config_fails_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_sise: 2\ntrain:\n  lr: -1\n")
    proc = cli("config", "show", str(path), check=False)
    assert proc.returncode == 2
    assert "rollout.group_sise: unknown key" in proc.stderr
    assert "train.lr: Input should be greater than 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_trajectories_export(tmp_path):
    run = tmp_path / "run"
    with TrajectoryStore(run) as store:
        store.append_many(
            [
                Episode(task_id="a", reward=1.0),
                Episode(task_id="b", status=EpisodeStatus.FAILED, error="x"),
            ]
        )
    lines = cli("trajectories", "export", str(run), "--format", "jsonl").stdout.splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == ["a", "b"]
    out = tmp_path / "ok.jsonl"
    proc = cli("trajectories", "export", str(run), "-o", str(out), "--status", "ok")
    assert "wrote 1 episodes" in proc.stderr
    assert json.loads(out.read_text())["task_id"] == "a"
    missing = cli("trajectories", "export", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 1 and "no trajectory store" in missing.stderr


CAMEL_AGENT = """
from camel.agents import ChatAgent


def solve(task):
    return 1.0
"""


@pytest.mark.skipif(importlib.util.find_spec("camel") is not None, reason="camel is installed")
@pytest.mark.parametrize("command", ["train", "rollout"])
def test_an_agent_missing_its_extra_fails_before_any_model_loads(tmp_path, command):
    # No model at model.path: a command that loaded it before the agent would fail on that.
    config = write_run(tmp_path, tmp_path / "no-model-here")
    (tmp_path / "toy_agent.py").write_text(CAMEL_AGENT)
    proc = cli(command, config, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip() == (
        "error: agent module 'toy_agent' imports 'camel', which is not installed: "
        'pip install "areal-sdk[camel]"'
    )


SHADOWING_AGENT = """
from openai import OpenAI

from helpers import PREFIX  # a sibling module, beside this file


def solve(task):
    reply = OpenAI().chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": PREFIX + task["question"]}],
        max_tokens=4,
    )
    return float(bool(reply.choices[0].message.content))
"""


def console_cli(*args, cwd):
    """The installed ``areal-sdk`` script, as a user runs it: no directory of theirs on
    sys.path (``python -m`` would put the current one first)."""
    script = Path(sys.executable).with_name("areal-sdk")
    return subprocess.run(
        [str(script), *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def stored_episodes(config: Path, run_id: str = "rollout"):
    with TrajectoryStore(config.parent / "run") as store:
        return store.query(run_id=run_id)


@pytest.mark.slow
def test_an_agent_file_named_like_a_framework_package_does_not_shadow_it(tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, agent={"entry": "agents:solve"}, data={"limit": 2})
    (tmp_path / "agents.py").write_text(SHADOWING_AGENT)  # the OpenAI Agents SDK is `agents`
    (tmp_path / "helpers.py").write_text('PREFIX = "Question: "\n')
    proc = console_cli("rollout", config.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "4 episodes (0 failed)" in proc.stdout
    episodes = stored_episodes(config)
    assert len(episodes) == 4 and all(len(e.turns) == 1 for e in episodes)
    prompt = episodes[0].turns[0].request["messages"][0]["content"]
    assert prompt.startswith("Question: What is")


LANGCHAIN_V1_AGENT = """
from langchain.agents import create_agent
from langchain_openai import ChatOpenAI

# Built at import, with no API key in the environment, as LangChain's docs write it.
agent = create_agent(ChatOpenAI(model="gpt-4o-mini", max_tokens=4), tools=[])


def solve(task):
    result = agent.invoke({"messages": [{"role": "user", "content": task["question"]}]})
    return float(result["messages"][-1].type == "ai")
"""


@pytest.mark.slow
def test_a_langchain_v1_agent_runs_and_is_captured(tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, data={"limit": 2})
    (tmp_path / "toy_agent.py").write_text(LANGCHAIN_V1_AGENT)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "areal_sdk", "rollout", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "4 episodes (0 failed)" in proc.stdout and "reward 1.000" in proc.stdout
    episodes = stored_episodes(config)
    assert len(episodes) == 4
    for episode in episodes:
        [turn] = episode.turns
        assert turn.api == "openai.chat" and turn.completion_ids
        assert turn.request["messages"][-1]["content"].startswith("What is")


def test_no_sglang_server_left_is_one_error_line(tmp_path, tiny_model_dir):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = write_run(
        tmp_path,
        tiny_model_dir,
        inference={"backend": "sglang", "urls": [f"http://127.0.0.1:{port}"], "retries": 0},
    )
    proc = cli("rollout", config, check=False)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: no SGLang server left") and f":{port}" in line


@pytest.mark.parametrize("command", [("rollout",), ("train", "--resume")])
def test_a_run_dir_whose_store_is_not_a_store_is_one_error_line(tmp_path, command):
    config = write_run(tmp_path, tmp_path / "no-model-here")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trajectories.db").write_text("notes, not a database\n" * 200)
    proc = cli(*command, config, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: cannot open the trajectory store "
        f"{tmp_path / 'run' / 'trajectories.db'}: file is not a database"
    )


def test_plugins_lists_what_each_plugin_registers_by_name():
    rows = {r["name"]: r for r in json.loads(cli("plugins", "--json").stdout)}
    assert {"exact_match", "answer_tag"} <= set(rows["builtin_rewards"]["provides"]["reward"])
    assert "jsonl" in rows["builtin_metrics"]["provides"]["metric_sink"]
    assert rows["openai"]["provides"]["adapter"] == ["openai"]
    train = rows["train"]["provides"]
    assert "torch" in train["train_backend"] and train["weight_sync"]
    table = wide_cli("plugins").stdout
    assert "reward: answer_tag, exact_match" in table
    assert "metric sink: " in table and "weight sync: " in table


def wide_cli(*args):
    """``cli`` with a terminal wide enough that rich never wraps a table cell."""
    proc = subprocess.run(
        [sys.executable, "-m", "areal_sdk", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.skipif(importlib.util.find_spec("camel") is not None, reason="camel is installed")
def test_plugins_table_prints_install_hints_verbatim():
    table = wide_cli("plugins").stdout
    camel = next(line for line in table.splitlines() if " camel " in line)
    assert 'missing camel: pip install "areal-sdk[camel]"' in camel


def test_rollout_prints_an_agents_error_as_written(tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, data={"limit": 1})
    (tmp_path / "toy_agent.py").write_text(
        "def solve(task):\n    raise RuntimeError('needs pip install \"areal-sdk[camel]\"')\n"
    )
    proc = cli("rollout", config)
    assert "2 episodes (2 failed)" in proc.stdout
    assert 'needs pip install "areal-sdk[camel]"' in proc.stdout
