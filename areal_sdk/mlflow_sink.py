"""The MLflow metric sink (``run.metric_sinks: [mlflow]``, extra ``mlflow``).

Every step's metrics at their step, the held-out reward (at step 0 and after the last step),
the resolved config as params (flattened, ``train.lr``) and as a ``config.yaml`` artifact,
and each step's sample of trajectories as a table artifact
(``trajectories/step_000001.json``, shown in the MLflow UI's artifact view and read back with
``mlflow.load_table``). Without a tracking URI (the option or ``MLFLOW_TRACKING_URI``) the
run goes to a SQLite store in the run directory: ``mlflow ui --backend-store-uri
sqlite:///RUN_DIR/mlflow.db``. The MLflow run id is kept in the run directory, so
``--resume`` continues the same MLflow run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from areal_sdk.hookspecs import PluginStatus, hookimpl
from areal_sdk.metrics import TRAJECTORY_COLUMNS, MetricSink
from areal_sdk.plugin_host import status_for_modules

RUN_ID_FILENAME = "mlflow_run_id"
_BATCH = 100  # MLflow's limit on params (and a sane one for metrics) in one log_batch
_PARAM_CHARS = 6000  # MLflow's limit on a param's value; config.yaml keeps it whole
log = logging.getLogger(__name__)
progress = logging.getLogger("areal_sdk.progress")  # the CLI shows it


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-4}}`` -> ``{"train.lr": 1e-4}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class MlflowSink:
    """One MLflow run per areal-sdk run. Options (``run.metric_sink_options.mlflow``):
    ``tracking_uri`` (default ``MLFLOW_TRACKING_URI``, else ``sqlite:///RUN_DIR/mlflow.db``),
    ``experiment`` (default ``MLFLOW_EXPERIMENT_NAME``, else ``areal-sdk``), ``run_name``
    (default the run directory's name) and ``tags``."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        run_dir = run_dir.absolute()
        run_dir.mkdir(parents=True, exist_ok=True)
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        # A store of the run's own keeps its artifacts beside it too (MLflow's default
        # artifact root is ./mlruns in the working directory).
        artifacts = None if uri else (run_dir / "mlartifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{run_dir / 'mlflow.db'}")
        name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "areal-sdk"
        found = self.client.get_experiment_by_name(name)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(name, artifact_location=artifacts)
        )
        id_file = run_dir / RUN_ID_FILENAME
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment_id, run_name=run_name or run_dir.name, tags=dict(tags or {})
            )
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id + "\n")
        progress.info("MLflow run %s in %s", self.run_id, self.client.tracking_uri)

    def _log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key, float(value), now, step)
            for key, value in metrics.items()
            if isinstance(value, int | float) and math.isfinite(value)
        ]
        for start in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start : start + _BATCH])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._log_metrics(step, metrics)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._log_metrics(step, metrics)

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        # A param cannot change once logged: a resumed run with other overrides keeps the
        # first values as params, and its config.yaml artifact holds what it runs with.
        flat = {key: str(value)[:_PARAM_CHARS] for key, value in _flatten(config).items()}
        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in flat.items() if logged.get(key, value) != value)
        if changed:
            log.info("MLflow params %s keep their first values; see config.yaml", changed)
        params = [Param(key, value) for key, value in flat.items() if key not in logged]
        for start in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + _BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.yaml")

    def log_trajectories(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = {column: [row[column] for row in rows] for column in TRAJECTORY_COLUMNS}
        self.client.log_table(self.run_id, table, f"trajectories/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@hookimpl
def areal_plugin_status() -> PluginStatus:
    return status_for_modules(("mlflow",), extra="mlflow", kind="metric sink")


@hookimpl
def areal_metric_sinks() -> Mapping[str, Callable[..., MetricSink]]:
    return {"mlflow": MlflowSink}
