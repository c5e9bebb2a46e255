"""End to end: the same workload trained with ``rollout.max_staleness`` 0 (synchronous), 2, 4.

One process runs what ``areal-sdk train`` runs (embedded engine, gateway, an OpenAI-SDK agent,
torch trainer, in-process weight pushes) on one device. The model is Qwen2-0.5B-shaped (24
layers, hidden 896, MLP 4864, 14 heads / 2 KV heads) with random weights and the test
tokenizer (512 tokens, so the body, not the vocabulary, is the cost). Each task asks for a
different number of new tokens (``--min-tokens`` to ``--max-tokens``, long-tailed), which is
what makes waiting for the slowest generation expensive in synchronous RL. Generations ignore
EOS, so every setting generates the same tokens for the same tasks: when a learning model
starts to stop early must not decide the comparison. The reward is the
share of digits in the reply, something a random model can learn.

Reports per setting: wall seconds per step after the first ``--warmup`` steps, training steps
per hour, mean GPU utilisation (NVML, sampled every 100 ms), the reward per step, and the
mean seconds per step spent waiting for rollouts (``time/wait_s``), pushing weights
(``time/push_s``) and training (the rest of ``time/step_s``) over the same steps.

With ``--engine-process`` the engine runs as ``areal-sdk engine`` in its own process (a fresh
one per setting, so no setting starts from another's trained weights), reached over SGLang's
protocol; weights go by ``--push-method`` (``cuda_ipc`` on CUDA: SGLang's
``/update_weights_from_tensor``, else ``disk``) with the engine paused in ``--pause-mode``
(default ``retract``).

    python benchmarks/e2e_staleness.py --device cuda --steps 10 --staleness 0,2,4 --json out.json
    python benchmarks/e2e_staleness.py --device cuda --engine-process ...   # engine apart
    python benchmarks/e2e_staleness.py --device cuda --staleness 0,4 --rounds 3  # mean, spread
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.shapes import QWEN2_05B  # noqa: E402

AGENT = """
import areal_sdk as areal
from openai import AsyncOpenAI

client = AsyncOpenAI()


@areal.trace
async def solve(task):
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=task["max_tokens"],
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    text = reply.choices[0].message.content or ""
    return sum(c.isdigit() for c in text) / max(len(text), 1)
"""


TIMES = ("wait_s", "push_s", "push_pause_s", "push_send_s", "push_resume_s", "step_s")
# Per-step rollout figures reported beside the times.
ROLLOUT = (
    "tokens_per_s",
    "staleness_mean",
    "dropped_stale_groups",
    "trained_tokens",
    "running",
    "buffered_groups",
    "admission_room",
)


def build_model(out: Path, layers: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(out)
    torch.manual_seed(0)
    config = Qwen2Config(
        **{
            **QWEN2_05B,
            "vocab_size": len(tokenizer),
            "num_hidden_layers": layers,
            "max_position_embeddings": 4096,
        },
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def write_tasks(path: Path, n: int, lo: int, hi: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            # Long-tailed lengths: most short, a few near the maximum.
            length = int(lo + (hi - lo) * rng.random() ** 3)
            f.write(json.dumps({"id": f"t{i}", "question": f"Count to {i}.", "max_tokens": length}))
            f.write("\n")


class GpuSampler:
    """Mean GPU utilisation over a window, from NVML."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:
            self._nvml = None

    def __enter__(self) -> GpuSampler:
        if self._nvml is not None:
            threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


class EngineLoadSampler:
    """Mean requests running and waiting in the engine, sampled every 100 ms: whether the
    admitted episodes really keep the engine's batch full."""

    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        self.run = run
        self.running: list[int] = []
        self.waiting: list[int] = []
        self._stop = threading.Event()

    def __enter__(self) -> EngineLoadSampler:
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            engine = getattr(getattr(self.run, "stack", None), "engine", None)
            running = getattr(engine, "num_running", None)
            if isinstance(running, int):
                self.running.append(running)
                self.waiting.append(int(getattr(engine, "num_waiting", 0)))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def engine_stats(self, url: str | None) -> dict[str, float] | None:
        """The engine's running totals now (``EmbeddedEngine.stats``), in process or from
        the engine process's ``/get_server_info``; None if unreadable."""
        try:
            fleet = getattr(self.run.stack, "fleet", None)
            if url or fleet is not None:
                import httpx

                # Under run.placement=processes: every engine server's totals, summed.
                totals: dict[str, float] = {}
                for server in [url] if url else fleet.urls:
                    stats = httpx.get(server + "/get_server_info", timeout=5).json()["stats"]
                    for key, value in stats.items():
                        totals[key] = totals.get(key, 0.0) + value
                return totals
            engine = self.run.stack.engine
            import dataclasses

            return dataclasses.asdict(engine.stats())
        except Exception:
            return None

    def means(self) -> dict[str, float | None]:
        return {
            "engine_running_mean": statistics.fmean(self.running) if self.running else None,
            "engine_waiting_mean": statistics.fmean(self.waiting) if self.waiting else None,
        }


def run_setting(
    work: Path,
    model: Path,
    args: argparse.Namespace,
    staleness: int,
    round_index: int = 0,
    placement: str = "auto",
) -> dict:
    from areal_sdk.cli.train import _run_until_signalled
    from areal_sdk.config import load_config
    from areal_sdk.training_run import TrainingRun

    run_dir = work / f"run-{placement}-s{staleness}-r{round_index}"
    overrides = [
        f"model.path={model}",
        "agent.entry=bench_agent:solve",
        f"data.path={work / 'tasks.jsonl'}",
        f"rollout.group_size={args.group_size}",
        f"rollout.batch_size={args.batch_size}",
        f"rollout.concurrency={args.concurrency}",
        f"rollout.max_staleness={staleness}",
        f"inference.device={args.device}",
        f"inference.max_new_tokens={args.max_tokens}",
        f"inference.max_batch_size={args.concurrency}",
        "inference.max_model_len=1024",
        f"train.device={args.device}",
        "train.lr=1e-5",
        *(
            [f"train.micro_batch_tokens={args.micro_batch_tokens}"]
            if args.micro_batch_tokens
            else []
        ),
        "algorithm.decoupled=true",
        f"run.dir={run_dir}",
        f"run.steps={args.steps}",
        "run.metric_sinks=[jsonl]",
        "eval.before=false",
        "eval.after=false",
        f"run.placement={placement}",
    ]
    if args.engine_url:
        # The engine in its own process (`areal-sdk engine`), reached over SGLang's protocol.
        overrides += [
            "inference.backend=sglang",
            f"inference.urls=[{args.engine_url}]",
            f"weights.method={args.push_method}",
        ]
        if args.push_method == "cuda_ipc" and args.device.startswith("cuda"):
            overrides.append("weights.dtype=bfloat16")  # what the engine holds on CUDA
    if args.pause_mode:
        overrides.append(f"weights.pause_mode={args.pause_mode}")
    overrides += args.set
    cfg = load_config(None, overrides)
    stamps: list[float] = []
    rewards: list[float] = []
    times: list[dict[str, float]] = []
    rollout: list[dict[str, float]] = []

    engine_totals: list[dict[str, float] | None] = []

    began = time.perf_counter()

    def progress(message: str) -> None:
        # On stderr as it happens: a run cut off by a time limit still shows how far it got.
        print(
            f"[{placement} s={staleness} +{time.perf_counter() - began:.1f}s] {message}",
            file=sys.stderr,
            flush=True,
        )

    def on_step(report) -> None:  # type: ignore[no-untyped-def]
        stamps.append(time.perf_counter())
        progress(f"step {len(stamps)} done")
        engine_totals.append(load.engine_stats(args.engine_url))
        if profiler is not None and len(stamps) == args.warmup + 1:
            profiler.start()
        rewards.append(report.metrics.get("rollout/reward_mean", float("nan")))
        times.append({k: report.metrics.get(f"time/{k}", float("nan")) for k in TIMES})
        rollout.append({k: report.metrics.get(f"rollout/{k}", float("nan")) for k in ROLLOUT})

    run = TrainingRun(cfg, config_dir=work, on_step=on_step, on_event=progress)
    start = time.perf_counter()
    load = EngineLoadSampler(run)
    profiler = (
        EngineProfile(run, args.profile_s, args.profile_dir)
        if args.profile_s and not args.engine_url and staleness == args.profile_staleness
        else None
    )
    with GpuSampler() as gpu, load:
        # SIGTERM or SIGINT (a `timeout` limit) ends the run after its step in flight, as
        # `areal-sdk train` does: the steps done so far are still reported.
        result = asyncio.run(_run_until_signalled(run))
    if profiler is not None:
        profiler.join()
    measured = stamps[args.warmup :]
    per_step = (measured[-1] - measured[0]) / (len(measured) - 1) if len(measured) > 1 else None
    # Over the steps after warmup (all of them if the run is shorter).
    steady = times[args.warmup :] or times
    split = {
        f"{k}_mean": statistics.fmean(t[k] for t in steady) if steady else None
        for k in ("wait_s", "push_s", "push_pause_s", "push_send_s", "push_resume_s")
    }
    split["train_s_mean"] = (
        statistics.fmean(t["step_s"] - t["wait_s"] - t["push_s"] for t in steady)
        if steady
        else None
    )
    steady_rollout = rollout[args.warmup :] or rollout
    for key in ROLLOUT:
        split[f"{key}_mean"] = (
            statistics.fmean(r[key] for r in steady_rollout) if steady_rollout else None
        )
    split.update(engine_window(engine_totals[args.warmup :], stamps[args.warmup :]))
    split.update(buffer_window([r["trained_tokens"] for r in rollout[args.warmup + 1 :]], split))
    if (drawn := split.get("buffer_steps_drawn")) is not None and drawn > 1:
        progress(
            f"not steady: the measured steps trained {drawn:.1f} steps' tokens more than the "
            f"engine generated meanwhile (episodes generated ahead during the warm-up); "
            f"generation alone allows {split['generation_bound_s_per_step']:.3f} s a step. "
            f"Give more --warmup steps."
        )
    return {
        "placement": run.placement,
        "max_staleness": staleness,
        "steps": result.steps,
        # What ran, after the placement's adjustments (run.cfg, not the overrides).
        "engine": "process"
        if args.engine_url
        else (
            f"{run.cfg.inference.servers} server process(es)"
            if run.placement == "processes"
            else f"{run.cfg.inference.servers} server actor(s)"
            if run.placement == "ray"
            else "in process"
        ),
        "push_method": run.cfg.weights.method,
        "pause_mode": run.cfg.weights.pause_mode,
        **split,
        "wall_s": time.perf_counter() - start,
        "s_per_step": per_step,
        "steps_per_hour": 3600 / per_step if per_step else None,
        "gpu_util_mean": gpu.mean,
        **load.means(),
        "reward_per_step": rewards,
        "reward_last3": statistics.fmean(rewards[-3:]) if len(rewards) >= 3 else None,
    }


class EngineProfile:
    """``--profile-s``: a torch profiler trace of every thread in this process for a window
    after the warm-up, with the engine's step, decode, prefill and sampling marked, written
    as a chrome trace and a table of host and device time per op."""

    def __init__(self, run, seconds: float, out: Path) -> None:  # type: ignore[no-untyped-def]
        self.run, self.seconds, self.out = run, seconds, out
        self.started = False

    def mark_engine(self) -> None:
        import torch
        from areal_sdk.backends.embedded import engine as engine_module

        engine = self.run.stack.engine
        engine = getattr(engine, "_engine", engine)

        def marked(name, fn):  # type: ignore[no-untyped-def]
            def call(*a, **k):  # type: ignore[no-untyped-def]
                with torch.profiler.record_function(name):
                    return fn(*a, **k)

            return call

        engine._step = marked("engine.step", engine._step)
        engine.runner.decode = marked("engine.decode", engine.runner.decode)
        engine.runner.forward = marked("engine.prefill", engine.runner.forward)
        engine_module.sample = marked("engine.sample", engine_module.sample)

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self.thread = threading.Thread(target=self._record, daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.started:
            self.thread.join()

    def _record(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.mark_engine()
        self.out.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(activities=activities, experimental_config=every_thread) as prof:
            time.sleep(self.seconds)
        prof.export_chrome_trace(str(self.out / "engine_trace.json"))
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=60)
        (self.out / "engine_ops.txt").write_text(table)


def engine_window(totals: list[dict[str, float] | None], stamps: list[float]) -> dict:
    """The engine's figures between the first and last reading: mean step time, decode rows
    per step, share of steps with a prefill, share of wall time inside steps, tokens/s."""
    if len(totals) < 2 or totals[0] is None or totals[-1] is None:
        return {}
    a, b = totals[0], totals[-1]
    d = {k: b[k] - a[k] for k in a}
    wall = stamps[-1] - stamps[0]
    return {
        "engine_step_ms": 1000 * d["step_s"] / d["steps"] if d["steps"] else None,
        "engine_decode_rows": d["decode_rows"] / d["decode_steps"] if d["decode_steps"] else None,
        "engine_prefill_share": d["prefill_steps"] / d["steps"] if d["steps"] else None,
        "engine_busy": d["step_s"] / wall if wall > 0 else None,
        "engine_tokens_per_s": d["sampled_tokens"] / wall if wall > 0 else None,
        "engine_sampled_tokens": d["sampled_tokens"],
        # Prompt positions copied from another request's cache (prefix_reuse) of all fed.
        "engine_reused_share": d.get("reused_tokens", 0)
        / max(d.get("reused_tokens", 0) + d["prefill_tokens"], 1),
    }


def buffer_window(trained_tokens: list[float], engine: dict) -> dict:
    """Whether the measured steps ran in steady state. An asynchronous run can train faster
    than its engine generates for a while, on episodes generated ahead during the warm-up
    (up to ``max_staleness`` steps of them): such a window's seconds per step are not what
    the run sustains. ``buffer_steps_drawn`` counts how many steps' tokens the window took
    beyond what the engine generated in it (negative: the engine generated more, for groups
    dropped as stale or still in flight); ``generation_bound_s_per_step`` is the step time
    the engine's rate allows if every token it generates is trained, and
    ``trained_share_of_generated`` how much of it was (the rest went on groups dropped as
    stale and on episodes still running when the window closed)."""
    rate = engine.get("engine_tokens_per_s")
    trained = [t for t in trained_tokens if t == t]  # NaN: a run without the metric
    if not trained or not rate:
        return {}
    per_step = statistics.fmean(trained)
    generated = engine["engine_sampled_tokens"]
    return {
        "trained_tokens_per_step": per_step,
        "buffer_steps_drawn": (sum(trained) - generated) / per_step if per_step else None,
        "generation_bound_s_per_step": per_step / rate,
        "trained_share_of_generated": sum(trained) / generated if generated else None,
    }


def stop_engine(proc) -> None:  # type: ignore[no-untyped-def]
    proc.terminate()
    try:
        proc.wait(30)
    except Exception:
        proc.kill()
        proc.wait(30)


def start_engine(model: Path, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """``areal-sdk engine`` on a free port; returns (process, url) once /health answers."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_sdk",
            "engine",
            "--model",
            str(model),
            "--port",
            str(port),
            "--device",
            args.device,
            "--max-batch-size",
            str(args.concurrency),
        ]
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the engine process exited while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_engine(proc)
    raise RuntimeError("the engine process did not answer /health within 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--staleness", default="0,2,4")
    parser.add_argument(
        "--placements",
        default="auto",
        help="run.placement values to compare, e.g. inprocess,processes (auto: the default)",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="default: the backend sizes it"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="serve the engine from `areal-sdk engine` in its own process (a fresh one per "
        "setting) instead of in process",
    )
    parser.add_argument(
        "--push-method",
        choices=["cuda_ipc", "disk", "broadcast"],
        help="--engine-process: weights.method (default cuda_ipc on cuda, else disk)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every setting, e.g. inference.prefill_chunk=4096",
    )
    parser.add_argument(
        "--pause-mode",
        choices=["retract", "in_place", "abort"],
        help="weights.pause_mode (default retract)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval (seconds) for this process: how long a thread that wants "
        "the GIL waits for a busy holder (default 0.005)",
    )
    parser.add_argument(
        "--profile-s",
        type=float,
        help="record a torch profiler trace of this many seconds after the warm-up (engine "
        "in process), into --profile-dir",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the --staleness list this many times, alternating the settings; the "
        "summary gives each setting's mean and spread",
    )
    parser.add_argument("--profile-staleness", type=int, default=2)
    parser.add_argument("--profile-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.push_method is None:
        args.push_method = "cuda_ipc" if args.device.startswith("cuda") else "disk"
    args.engine_url = None
    work = Path(tempfile.mkdtemp(prefix="e2e-"))
    (work / "bench_agent.py").write_text(AGENT)
    write_tasks(work / "tasks.jsonl", 512, args.min_tokens, args.max_tokens)
    model = build_model(work / "model", args.layers)
    results = []
    settings = [int(x) for x in args.staleness.split(",")]
    placements = args.placements.split(",")
    # Rounds alternate the settings, so a machine that slows down part-way (shared hosts do)
    # weighs on every setting alike.
    for round_index in range(args.rounds):
        for placement in placements:
            for s in settings:
                engine = None
                try:
                    if args.engine_process:
                        engine, args.engine_url = start_engine(model, args)
                    row = run_setting(work, model, args, s, round_index, placement)
                except Exception as exc:  # one setting failing must not hide the others
                    row = {"max_staleness": s, "error": f"{type(exc).__name__}: {exc}"}
                finally:
                    if engine is not None:
                        stop_engine(engine)
                row["round"] = round_index
                row["placement_asked"] = placement
                print(json.dumps(row), flush=True)
                results.append(row)
    for r in results:
        base = next(
            (
                b
                for b in results
                if b["round"] == r["round"]
                and b["placement_asked"] == r["placement_asked"]
                and b.get("max_staleness") == 0
                and b.get("s_per_step")
            ),
            None,
        )
        if base and r.get("s_per_step"):
            r["speedup_vs_sync"] = base["s_per_step"] / r["s_per_step"]
    by_setting: dict[str, dict[str, float]] = {}
    for placement in placements:
        for s in settings:
            times = [
                r["s_per_step"]
                for r in results
                if r["max_staleness"] == s
                and r["placement_asked"] == placement
                and r.get("s_per_step")
            ]
            if times:
                by_setting[f"{placement}/s{s}"] = {
                    "s_per_step_mean": statistics.fmean(times),
                    "s_per_step_stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
                    "rounds": len(times),
                }
        sync = by_setting.get(f"{placement}/s0")
        if sync:
            for key, entry in by_setting.items():
                if key.startswith(f"{placement}/"):
                    entry["speedup_of_means"] = sync["s_per_step_mean"] / entry["s_per_step_mean"]
    summary = {
        "args": vars(args) | {"json": str(args.json), "profile_dir": str(args.profile_dir)},
        "results": results,
        "by_setting": by_setting,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
