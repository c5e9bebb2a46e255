"""The Weights & Biases metric sink (``run.metric_sinks: [wandb]``, extra ``wandb``).

Every step's metrics against the training step, the held-out reward (history and summary),
the resolved config as the W&B run's config, and each step's sample of trajectories as a
``wandb.Table``. Without an API key (``WANDB_API_KEY`` or ``wandb login``) and without
``WANDB_MODE``, the run is written offline under the run directory: ``wandb sync`` uploads it
later. The W&B run id is kept in the run directory, so ``--resume`` continues the same W&B
run.
"""

from __future__ import annotations

import logging
import math
import netrc
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from areal_sdk.hookspecs import PluginStatus, hookimpl
from areal_sdk.metrics import TRAJECTORY_COLUMNS, MetricSink
from areal_sdk.plugin_host import status_for_modules

RUN_ID_FILENAME = "wandb_run_id"
STEP_KEY = "step"
# Where the run is, shown by the CLI as a progress line.
progress = logging.getLogger("areal_sdk.progress")


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}


class WandbSink:
    """One W&B run per areal-sdk run. Options (``run.metric_sink_options.wandb``) are
    ``wandb.init``'s: ``project`` (default ``areal-sdk``), ``entity``, ``name`` (default the
    run directory's name), ``group``, ``tags``, ``mode`` (``online``, ``offline``,
    ``disabled``) and ``dir`` (default the run directory); W&B's environment variables
    (``WANDB_PROJECT``, ``WANDB_MODE``, ...) apply where an option is not set."""

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] | None = None,
        mode: str | None = None,
        dir: str | None = None,
    ) -> None:
        import wandb

        self._wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILENAME
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B run ids are short alphanumerics
            id_file.write_text(run_id + "\n")
        # W&B would start Weave, which sends the agent's LLM calls to W&B, when the agent
        # imported it: trajectories leave the machine only through an exporter turned on.
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        if mode is None and not os.environ.get("WANDB_MODE") and not _has_api_key():
            mode = "offline"
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "areal-sdk",
            entity=entity,
            name=name or run_dir.name,
            group=group,
            tags=list(tags) if tags else None,
            mode=mode,  # type: ignore[arg-type]
            dir=dir or os.environ.get("WANDB_DIR") or str(run_dir),
            id=run_id,
            resume="allow",
            # Leave the CLI's stdout alone: W&B would otherwise wrap it to upload the console.
            settings=wandb.Settings(console="off", silent=True),
        )
        # Charts over the training step; the held-out reward before training sits at step 0.
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        if self.run.offline:
            offline_dir = Path(self.run.dir).parent
            progress.info("W&B run %s offline: `wandb sync %s` uploads it", run_id, offline_dir)
        else:
            progress.info("W&B run %s", self.run.url)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**_finite(metrics), STEP_KEY: step})

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        finite = _finite(metrics)
        self.run.log({**finite, STEP_KEY: step})
        self.run.summary.update(finite)

    def log_trajectories(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        data = [[row[column] for column in TRAJECTORY_COLUMNS] for row in rows]
        table = self._wandb.Table(columns=list(TRAJECTORY_COLUMNS), data=data)
        self.run.log({"trajectories": table, STEP_KEY: step})

    def close(self) -> None:
        self.run.finish()


@hookimpl
def areal_plugin_status() -> PluginStatus:
    return status_for_modules(("wandb",), extra="wandb", kind="metric sink")


@hookimpl
def areal_metric_sinks() -> Mapping[str, Callable[..., MetricSink]]:
    return {"wandb": WandbSink}
