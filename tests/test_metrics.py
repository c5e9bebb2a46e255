import json
import math

from areal_sdk.metrics import MetricLogger, plot_reward_curve, read_metrics
from areal_sdk.plugin_host import PluginHost


def test_builtin_sinks_write_jsonl_tensorboard_and_a_reward_curve(tmp_path):
    host = PluginHost()
    sinks = host.metric_sinks()
    assert {"jsonl", "tensorboard"} <= set(sinks)
    logger = MetricLogger([sinks["jsonl"](tmp_path), sinks["tensorboard"](tmp_path)])
    for step in range(1, 5):
        logger.log(step, {"rollout/reward_mean": step / 4, "loss": math.nan})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["rollout/reward_mean"] == 0.5 and rows[1]["loss"] is None  # NaN is not JSON
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_reward_curve(tmp_path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_metrics_no_plot(tmp_path):
    assert plot_reward_curve(tmp_path) is None


def _tensorboard_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Steps 3-4 ran, the process died after the checkpoint of step 2; the resumed run
    trains 3-4 again: the sinks forget the first 3-4, so the curve does not zigzag."""
    sinks = PluginHost().metric_sinks()

    def logger():
        return MetricLogger([sinks["jsonl"](tmp_path), sinks["tensorboard"](tmp_path)])

    first = logger()
    for step in range(1, 5):
        first.log(step, {"rollout/reward_mean": 0.0})
    first.close()
    resumed = logger()
    resumed.drop_after(2)
    for step in (3, 4, 5):
        resumed.log(step, {"rollout/reward_mean": 1.0})
    resumed.close()
    expected = [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0)]
    assert [(r["step"], r["rollout/reward_mean"]) for r in read_metrics(tmp_path)] == expected
    assert _tensorboard_scalars(tmp_path, "rollout/reward_mean") == expected


def test_the_reward_curve_shows_the_held_out_reward_without_training_steps(tmp_path):
    before = {"episodes": 4, "failed": 0, "mean": 0.25, "sem": 0.1, "seconds": 1, "version": 0}
    (tmp_path / "eval.json").write_text(json.dumps({"before": before}))
    png = plot_reward_curve(tmp_path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
