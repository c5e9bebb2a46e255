"""The ``areal-sdk`` command as a user runs it: a real subprocess."""

import json
import subprocess
import sys

from areal_sdk.store import TrajectoryStore
from areal_sdk.trajectory import Episode, EpisodeStatus


def cli(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "areal_sdk", *args], capture_output=True, text=True, timeout=120
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
