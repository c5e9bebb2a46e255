"""The W&B and MLflow sinks, offline: what a run logs is read back with each library's own
files and client."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys
from pathlib import Path

import pytest

from areal_sdk.evaluation import EvalResult, held_out_metrics
from areal_sdk.metrics import MetricLogger, open_sink, trajectory_rows
from areal_sdk.plugin_host import PluginError, PluginHost
from areal_sdk.trajectory import Episode, Turn

CONFIG = {"train": {"lr": 1e-4, "backend": "torch"}, "run": {"steps": 3, "metric_sinks": ["x"]}}
BEFORE = EvalResult(episodes=4, failed=0, mean=0.25, sem=0.1, seconds=1.0, version=0)
AFTER = EvalResult(episodes=4, failed=0, mean=0.75, sem=0.1, seconds=1.0, version=3)


def _episode(reward: float) -> Episode:
    turn = Turn(
        api="openai.chat", prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], versions=[2]
    )
    return Episode(task_id="t7", reward=reward, turns=[turn])


def _log_a_run(logger: MetricLogger) -> list[dict]:
    """What a three-step run logs, in the order a run logs it."""
    logger.log_config(CONFIG)
    logger.log_eval(0, held_out_metrics(BEFORE))
    rows = []
    for step in (1, 2, 3):
        logger.log(step, {"rollout/reward_mean": step / 4, "train/loss": math.nan})
        rows = trajectory_rows(step, [_episode(1.0), _episode(0.0)], lambda ids: f"ids{ids}")
        logger.log_trajectories(step, rows)
    logger.log_eval(3, held_out_metrics(BEFORE, AFTER))
    logger.close()
    return rows


# -- W&B -------------------------------------------------------------------------------------


def wandb_records(run_file: Path):
    """The records of a ``run-ID.wandb`` transaction log: W&B's 7-byte header, then LevelDB's
    log format (32 KiB blocks of chunks, each with a crc, a length and a type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_run(wandb_dir: Path) -> tuple[list[dict], dict, dict, Path]:
    """History rows, the final summary, the config and the files directory of the one run."""
    import wandb

    wandb.teardown()  # the W&B service writes the log's last records after finish() returns
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, summary, config = [], {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "summary":
            for item in record.summary.update:
                summary["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    return history, summary, config, run_file.parent / "files"


def test_wandb_sink_runs_offline_without_a_key_and_logs_steps_eval_config_and_trajectories(
    tmp_path, monkeypatch, capfd, caplog
):
    caplog.set_level(logging.INFO, logger="areal_sdk.progress")
    import openai  # noqa: F401  (an agent's framework: W&B offers to trace it with Weave)

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a W&B key either
    run_dir = tmp_path / "run"
    factory = PluginHost().metric_sink("wandb")
    rows = _log_a_run(MetricLogger([open_sink("wandb", factory, run_dir, {"project": "p"})]))

    history, summary, config, files = read_wandb_run(run_dir)  # offline, under the run directory
    assert f"`wandb sync {files.parent}` uploads it" in caplog.text
    steps = [
        (h["step"], h.get("rollout/reward_mean")) for h in history if "trajectories/_type" not in h
    ]
    assert steps == [(0, None), (1, 0.25), (2, 0.5), (3, 0.75), (3, None)]
    assert not any("train/loss" in h for h in history)  # NaN is not logged
    assert history[0]["eval/before_mean"] == 0.25
    assert summary["eval/before_mean"] == 0.25 and summary["eval/after_mean"] == 0.75
    assert summary["eval/gain"] == pytest.approx(0.5)
    assert config["train"] == {"lr": 1e-4, "backend": "torch"}
    tables = [h for h in history if h.get("trajectories/_type") == "table-file"]
    assert [t["step"] for t in tables] == [1, 2, 3]
    table = json.loads((files / tables[-1]["trajectories/path"]).read_text())
    assert table["columns"] == ["step", "episode", "task", "turn", "prompt", "completion", "reward"]
    assert [r[4:] for r in table["data"]] == [
        ["ids[1, 2]", "ids[3]", 1.0],
        ["ids[1, 2]", "ids[3]", 0.0],
    ]
    assert table["data"][0][1] == rows[0]["episode"]
    assert "Weave" not in capfd.readouterr().err  # the agent's calls are not sent to W&B


def test_wandb_sink_resumes_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    factory = PluginHost().metric_sink("wandb")
    first = factory(tmp_path / "run")
    first.close()
    again = factory(tmp_path / "run")
    again.close()
    assert first.run.id == again.run.id


# -- MLflow ----------------------------------------------------------------------------------


def test_mlflow_sink_logs_steps_eval_params_and_a_trajectories_table(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    options = {"tracking_uri": uri, "experiment": "tiny", "run_name": "first"}
    factory = PluginHost().metric_sink("mlflow")
    sink = open_sink("mlflow", factory, tmp_path / "run", options)
    rows = _log_a_run(MetricLogger([sink]))

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(sink.run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    history = client.get_metric_history(sink.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert client.get_metric_history(sink.run_id, "train/loss") == []  # NaN is not logged
    before = client.get_metric_history(sink.run_id, "eval/before_mean")
    assert [(m.step, m.value) for m in before] == [(0, 0.25), (3, 0.25)]
    assert run.data.metrics["eval/gain"] == pytest.approx(0.5)
    assert run.data.params["train.lr"] == "0.0001" and run.data.params["run.steps"] == "3"
    artifacts = {a.path for a in client.list_artifacts(sink.run_id)}
    assert {"config.yaml", "trajectories"} <= artifacts
    table = json.loads(
        Path(client.download_artifacts(sink.run_id, "trajectories/step_000003.json")).read_text()
    )
    assert table["columns"] == list(rows[0])
    assert [r[4:] for r in table["data"]] == [
        ["ids[1, 2]", "ids[3]", 1.0],
        ["ids[1, 2]", "ids[3]", 0.0],
    ]

    # --resume continues the same MLflow run; a changed override keeps its first param.
    resumed = factory(tmp_path / "run", tracking_uri=uri, experiment="tiny")
    resumed.log_config({**CONFIG, "run": {"steps": 5}})
    resumed.log(4, {"rollout/reward_mean": 1.0})
    resumed.close()
    assert resumed.run_id == sink.run_id
    history = client.get_metric_history(sink.run_id, "rollout/reward_mean")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert client.get_run(sink.run_id).data.params["run.steps"] == "3"


# -- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_sink_whose_library_is_missing_names_its_extra(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # import and find_spec see it missing
    with pytest.raises(PluginError) as caught:
        PluginHost().metric_sink(name)
    assert str(caught.value) == (
        f"metric sink '{name}' (plugin '{name}') is unusable here: missing {name}: "
        f'pip install "areal-sdk[{name}]"'
    )


def test_an_unknown_sink_option_is_named(tmp_path):
    factory = PluginHost().metric_sink("mlflow")
    with pytest.raises(ValueError, match="run.metric_sink_options.mlflow: unknown option"):
        open_sink("mlflow", factory, tmp_path, {"tracking_url": "x"})
