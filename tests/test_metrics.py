import json
import math

from areal_sdk.metrics import MetricLogger, plot_reward_curve, read_metrics
from areal_sdk.plugin_host import PluginHost


def test_builtin_sinks_write_jsonl_tensorboard_and_a_reward_curve(tmp_path):
    host = PluginHost()
    sinks = host.metric_sinks()
    assert {"jsonl", "tensorboard"} <= set(sinks)
    logger = MetricLogger([sinks["jsonl"](tmp_path), sinks["tensorboard"](tmp_path)])
    for step in range(4):
        logger.log(step, {"rollout/reward_mean": step / 4, "loss": math.nan})
    logger.log(3, {"eval/reward_mean": 0.9})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3]
    assert rows[1]["rollout/reward_mean"] == 0.25 and rows[1]["loss"] is None  # NaN is not JSON
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_reward_curve(tmp_path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_metrics_no_plot(tmp_path):
    assert plot_reward_curve(tmp_path) is None
