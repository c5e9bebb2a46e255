"""Trainer memory and step time, LoRA (``train.lora``) against full fine-tuning.

Model: Qwen2-0.5B-shaped (vocabulary 151,936, 24 layers, hidden 896), random weights built
locally (``train_throughput.build``), bf16 autocast over fp32 master weights. Each variant
runs in a fresh process (so one's memory never counts against the other): the torch backend
builds, runs ``--steps`` GRPO steps on ``--seqs`` x ``--seq-len`` tokens, and merges its
weights for a push once (``state_for_sync``, what the engine receives). Reported per
variant: the trainable parameters, the step times, the peak CUDA memory of the whole run
(model, gradients, optimizer state, activations), and the merge-and-gather time of a push.

    python benchmarks/lora.py --json lora.json                 # CUDA, the 0.5B model
    python benchmarks/lora.py --device cpu --tiny --steps 2    # smoke run, the tiny model
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

VOCAB = 151936


def variant_overrides(name: str, args: argparse.Namespace) -> list[str]:
    if name == "full":
        return []
    if name == "lora":
        targets = args.target_modules
        return [
            f"train.lora.r={args.rank}",
            f"train.lora.alpha={2 * args.rank}",
            f"train.lora.target_modules={targets if targets == 'all-linear' else targets.split(',')}",
        ]
    raise ValueError(f"unknown variant {name!r}: full | lora")


def run_variant(path: Path, name: str, args: argparse.Namespace) -> dict:
    """One variant, in this process: build, train, push once; the numbers."""
    from train_throughput import samples

    from areal_sdk.algorithms.advantages import sample_advantages
    from areal_sdk.algorithms.losses import make_loss_fn
    from areal_sdk.config import load_config
    from areal_sdk.packing import pack_samples
    from areal_sdk.plugin_host import get_host

    cuda = args.device.startswith("cuda")
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            f"train.device={args.device}",
            f"train.bf16={str(cuda).lower()}",
            f"train.micro_batch_tokens={args.micro_batch_tokens}",
            "train.lr=1e-5",
            f"train.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
            *variant_overrides(name, args),
        ],
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    backend = get_host().train_backend(cfg.train.backend)(cfg)
    sync()
    loaded = torch.cuda.memory_allocated() / 2**30 if cuda else None
    trainable = sum(p.numel() for g in backend.optimizer.param_groups for p in g["params"])
    vocab = args.vocab or VOCAB
    batch = samples(args.seqs, args.seq_len, vocab)
    advantages = sample_advantages(batch, "grpo")
    loss_fn = make_loss_fn(cfg.algorithm, current_version=0)
    times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        (micro_batches,) = pack_samples(batch, advantages, cfg.train.micro_batch_tokens)
        backend.train_step(micro_batches, loss_fn)
        sync()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    pushed = sum(t.numel() for bucket in backend.state_for_sync(256 << 20) for _, t in bucket)
    sync()
    push_s = time.perf_counter() - start
    row = {
        "variant": name,
        "overrides": variant_overrides(name, args),
        "trainable_params": trainable,
        "pushed_params": pushed,
        "step_s": times,
        "step_s_median": statistics.median(times[1:] or times),
        "push_merge_s": push_s,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    if cuda:
        row["model_loaded_gib"] = loaded
        row["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:  # the process's peak resident memory, model and all (Linux reports KiB)
        row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def build_model(args: argparse.Namespace) -> Path:
    out = Path(tempfile.mkdtemp(prefix="lora-bench-")) / "model"
    if args.tiny:
        from tests.tiny_model import build_tiny_model

        return build_tiny_model(out, None)
    from train_throughput import build

    return build(out, args.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model (smoke run)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--target-modules", default="all-linear", help="all-linear | a,b,c")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--variants", default="full,lora")
    parser.add_argument("--json", type=Path)
    # Internal: run one variant on a built model and print its row.
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny and args.vocab is None:
        args.vocab = 300  # inside the tiny model's vocabulary
        if args.seq_len == 2048:
            args.seq_len, args.seqs, args.micro_batch_tokens = 128, 4, 512
    if args.variant is not None:
        print(json.dumps(run_variant(args.model, args.variant, args)), flush=True)
        return
    path = build_model(args)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    passed = [a for a in sys.argv[1:] if a not in ("--json", str(args.json))]
    for name in args.variants.split(","):
        cmd = [sys.executable, __file__, *passed, "--model", str(path), "--variant", name]
        if args.vocab is not None:
            cmd += ["--vocab", str(args.vocab)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            report[name] = {"error": done.stderr.strip().splitlines()[-1:]}
        else:
            report[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps({name: report[name]}), flush=True)
    full, lora = report.get("full", {}), report.get("lora", {})
    memory = "peak_cuda_gib" if "peak_cuda_gib" in full else "peak_rss_gib"
    if memory in full and memory in lora:
        print(
            f"full  {full['step_s_median']:.3f} s/step  {full[memory]:.2f} GiB ({memory})\n"
            f"lora  {lora['step_s_median']:.3f} s/step  {lora[memory]:.2f} GiB  "
            f"({lora['trainable_params']:,} of {lora['pushed_params']:,} params train)",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
