"""An areal-sdk metric sink: every step's metrics and the held-out reward, one CSV row each
(``step,name,value``), in ``RUN_DIR/metrics.csv``.

Use it with ``run.metric_sinks: [jsonl, csv]``; ``run.metric_sink_options.csv.filename``
names another file.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping
from pathlib import Path

from areal_sdk import hookimpl


class CsvSink:
    def __init__(self, run_dir: Path, *, filename: str = "metrics.csv") -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / filename
        new = not path.exists()
        self._file = path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "name", "value"])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            if math.isfinite(value):
                self._writer.writerow([step, name, value])
        self._file.flush()

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        # Optional: the held-out reward (eval/before_mean, eval/gain, ...).
        self.log(step, metrics)

    def close(self) -> None:
        self._file.close()


@hookimpl
def areal_metric_sinks() -> Mapping[str, Callable[..., CsvSink]]:
    return {"csv": CsvSink}
