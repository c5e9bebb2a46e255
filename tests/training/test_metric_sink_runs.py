"""Metric sinks in a real ``areal-sdk train``: MLflow, and the third-party CSV sink of
examples/plugins/csv_sink installed from its own directory as docs/plugins.md shows."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_metric_sinks import read_wandb_run

EXAMPLE = Path(__file__).parents[2] / "examples" / "plugins" / "csv_sink"


@pytest.fixture(scope="module")
def csv_sink_path(tmp_path_factory) -> Path:
    """The example installed with pip (no dependencies: areal-sdk is here already) into a
    directory of its own; on ``PYTHONPATH`` its entry point is seen as any installed one."""
    work = tmp_path_factory.mktemp("csv_sink")
    source = shutil.copytree(EXAMPLE, work / "source")  # pip builds in the source tree
    target = work / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "--target", str(target), str(source)],
        check=True,
        timeout=300,
    )
    return target


def cli(
    *args, pythonpath: Path | None = None, env: dict[str, str] | None = None, timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {})}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "areal_sdk", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
def test_the_installed_csv_sink_is_listed_by_areal_sdk_plugins(csv_sink_path):
    done = cli("plugins", "--json", pythonpath=csv_sink_path)
    assert done.returncode == 0, done.stderr
    (plugin,) = [p for p in json.loads(done.stdout) if p["name"] == "csv_sink"]
    assert plugin["provides"] == {"metric_sink": ["csv"]}
    assert plugin["source"] == "areal-csv-sink 0.1.0" and plugin["usable"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a whole run with four sinks, on a CPU others share
def test_a_run_logs_every_step_to_mlflow_wandb_and_the_third_party_csv_sink(
    run_config, csv_sink_path
):
    from mlflow.tracking import MlflowClient

    config = run_config(run={"steps": 2, "metric_sinks": ["jsonl", "mlflow", "wandb", "csv"]})
    offline = {"WANDB_MODE": "offline", "WANDB_API_KEY": ""}
    done = cli("train", config, pythonpath=csv_sink_path, env=offline, timeout=540)
    assert done.returncode == 0, done.stderr + done.stdout
    run_dir = config.parent / "run"
    assert "wandb sync" in done.stderr and "MLflow run" in done.stderr  # where each run is

    # MLflow, in its default store in the run directory: every step, the held-out reward,
    # the config as params and each step's trajectories decoded.
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    steps = [m.step for m in client.get_metric_history(run_id, "rollout/reward_mean")]
    assert steps == [1, 2]
    versions = client.get_metric_history(run_id, "weights/version")
    assert [(m.step, m.value) for m in versions] == [(1, 1.0), (2, 2.0)]
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert run.data.metrics["eval/before_mean"] == pytest.approx(evaluation["before"]["mean"])
    assert run.data.metrics["eval/after_mean"] == pytest.approx(evaluation["after"]["mean"])
    assert "eval/gain" in run.data.metrics
    assert run.data.params["agent.entry"] == "toy_agent:solve"
    assert run.data.params["run.steps"] == "2"
    tables = [a.path for a in client.list_artifacts(run_id, "trajectories")]
    assert tables == [f"trajectories/step_00000{s}.json" for s in (1, 2)]
    table = json.loads(Path(client.download_artifacts(run_id, tables[-1])).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len({r["episode"] for r in rows}) == 4  # run.trajectory_samples episodes
    assert all("What is" in r["prompt"] and "<|im_start|>assistant" in r["prompt"] for r in rows)
    assert all(r["step"] == 2 and r["reward"] in (0.0, 1.0) for r in rows)

    # W&B, offline under the run directory: the same steps, the gain, the decoded tables.
    history, summary, wandb_config, files = read_wandb_run(run_dir)
    assert [h["step"] for h in history if "rollout/reward_mean" in h] == [1, 2]
    assert summary["eval/gain"] == pytest.approx(run.data.metrics["eval/gain"])
    assert wandb_config["agent"]["entry"] == "toy_agent:solve"
    tables = [h for h in history if h.get("trajectories/_type") == "table-file"]
    assert [t["step"] for t in tables] == [1, 2]
    table = json.loads((files / tables[-1]["trajectories/path"]).read_text())
    assert [row[4] for row in table["data"]] == [r["prompt"] for r in rows]  # as MLflow's

    # The third-party sink got the same steps and the held-out reward.
    with (run_dir / "metrics.csv").open() as f:
        logged = list(csv.DictReader(f))
    rewards = [int(r["step"]) for r in logged if r["name"] == "rollout/reward_mean"]
    assert rewards == [1, 2]
    assert {r["name"] for r in logged if r["step"] == "0"} == {
        "eval/before_mean",
        "eval/before_sem",
    }


def test_train_with_a_sink_whose_library_is_missing_fails_at_start_naming_the_extra(run_config):
    config = run_config(run={"metric_sinks": ["jsonl", "wandb"]})
    hide_wandb = "import sys; sys.modules['wandb'] = None; from areal_sdk.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hide_wandb, "train", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "error: metric sink 'wandb' (plugin 'wandb') is unusable here: missing wandb: "
        'pip install "areal-sdk[wandb]"'
    ]
    assert "starting the engine" not in done.stdout


def test_train_names_an_unknown_sink_option(run_config):
    config = run_config(
        run={"metric_sinks": ["mlflow"], "metric_sink_options": {"mlflow": {"uri": "x"}}}
    )
    done = cli("train", config)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: run.metric_sink_options.mlflow: unknown option(s) uri; the mlflow sink takes: "
        "tracking_uri, experiment, run_name, tags"
    ]
