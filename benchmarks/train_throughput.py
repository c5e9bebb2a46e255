"""Training tokens/s and MFU of the torch train backend against a plain torch AdamW loop, and
weight-push latency into the embedded engine, on one device.

Model: Qwen2-0.5B-shaped (real vocabulary of 151,936, 24 layers, hidden 896), random weights,
bf16 autocast over fp32 master weights, gradient checkpointing, ``--seq-len`` tokens per
sequence. The backend runs the full GRPO step the trainer runs (proximal forward, fused
logprobs, PPO loss); the baseline is ``model(input_ids, labels=...)`` cross-entropy with
``torch.optim.AdamW(fused=True)``. MFU counts 6 x parameters x tokens (+ attention) per step
against ``--peak-tflops`` (H200 dense bf16: 989).

    python benchmarks/train_throughput.py --seqs 16 --seq-len 2048 --steps 4 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.shapes import QWEN2_05B  # noqa: E402


def build(out: Path, layers: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import build_tokenizer

    build_tokenizer(out)  # the engine loads one; only the weights are timed
    torch.manual_seed(0)
    config = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": layers})
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def flops_per_token(n_params: int, layers: int, hidden: int, seq: int) -> float:
    # 6N for the matmuls, plus causal attention scores and values (fwd + bwd).
    return 6 * n_params + 6 * layers * hidden * seq


def samples(n: int, seq: int, vocab: int):  # type: ignore[no-untyped-def]
    from areal_sdk.samples import TrainingSample

    rng = random.Random(0)
    prompt = seq // 4
    out = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(seq)]
        mask = [0] * prompt + [1] * (seq - prompt)
        out.append(
            TrainingSample(
                episode_id=f"e{i}",
                group_id=f"g{i // 4}",
                task_id=f"t{i // 4}",
                turn_ids=[f"u{i}"],
                input_ids=ids,
                loss_mask=mask,
                logprobs=[-2.0] * seq,
                versions=[0] * seq,
                reward=float(i % 2),
            )
        )
    return out


# Backend variants: name -> (config overrides, separate proximal pass).
VARIANTS: dict[str, tuple[list[str], bool]] = {
    # What a user gets: every train setting left at its default (on CUDA: bf16, compiled
    # layers, micro-batches sized from the card's memory).
    "defaults": ([], False),
    # The defaults with the vocabulary head on every row, prompt rows included (as before
    # ``MicroBatch.head_rows``).
    "defaults_every_row": ([], False),
    # The defaults with the logprob head keeping its softmax for backward.
    "defaults_stored": (["train.logprob_backend=stored"], False),
    # The layout of the first measurement: masked packed row, checkpointing, extra pass.
    "sdpa_gc_prox": (["train.attn_implementation=sdpa", "train.gradient_checkpointing=true"], True),
    "varlen_gc": (["train.attn_implementation=varlen", "train.gradient_checkpointing=true"], False),
    "varlen": (["train.attn_implementation=varlen", "train.gradient_checkpointing=false"], False),
    "varlen_compile": (
        [
            "train.attn_implementation=varlen",
            "train.gradient_checkpointing=false",
            "train.compile=true",
        ],
        False,
    ),
    # One micro-batch per step (16 x 2k tokens): the host work per kernel halves again.
    "varlen_compile_mb32k": (
        [
            "train.attn_implementation=varlen",
            "train.gradient_checkpointing=false",
            "train.compile=true",
            "train.micro_batch_tokens=32768",
        ],
        False,
    ),
    # The same with flash varlen attention only (``auto`` pads equal-length sequences for cuDNN).
    "varlen_compile_mb32k_flash": (
        [
            "train.attn_implementation=varlen",
            "train.varlen_kernel=flash",
            "train.gradient_checkpointing=false",
            "train.compile=true",
            "train.micro_batch_tokens=32768",
        ],
        False,
    ),
    "padded": (
        [
            "train.attn_implementation=sdpa",
            "train.padded_attention=true",
            "train.gradient_checkpointing=false",
        ],
        False,
    ),
    "deepspeed_varlen": (
        [
            "train.backend=deepspeed",
            "train.zero_stage=0",
            "train.attn_implementation=varlen",
            "train.gradient_checkpointing=false",
        ],
        False,
    ),
    "deepspeed_compile_mb32k": (
        [
            "train.backend=deepspeed",
            "train.zero_stage=0",
            "train.attn_implementation=varlen",
            "train.gradient_checkpointing=false",
            "train.compile=true",
            "train.micro_batch_tokens=32768",
        ],
        False,
    ),
}


def _pinned(args: argparse.Namespace) -> list[str]:
    """The settings every variant but ``defaults`` fixes (its own overrides come after)."""
    out = ["train.bf16=true", f"train.logprob_backend={args.logprob_backend}"]
    if args.micro_batch_tokens is not None:
        out.append(f"train.micro_batch_tokens={args.micro_batch_tokens}")
    return out


def time_backend(path: Path, args: argparse.Namespace, variant: str) -> dict:
    from areal_sdk.algorithms.advantages import sample_advantages
    from areal_sdk.algorithms.losses import make_loss_fn
    from areal_sdk.config import load_config
    from areal_sdk.packing import pack_samples
    from areal_sdk.plugin_host import get_host

    overrides, separate_proximal = VARIANTS[variant]
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            "train.device=cuda",
            "train.lr=1e-6",
            *([] if variant.startswith("defaults") else _pinned(args)),
            *overrides,
        ],
    )
    backend = get_host().train_backend(cfg.train.backend)(cfg)
    batch = samples(args.seqs, args.seq_len, 151936)
    adv = sample_advantages(batch, "grpo")
    loss_fn = make_loss_fn(cfg.algorithm, current_version=0)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        (mbs,) = pack_samples(batch, adv, backend.micro_batch_tokens)
        if variant == "defaults_every_row":
            mbs = [dataclasses.replace(mb, head_rows=None) for mb in mbs]
        if separate_proximal:
            for mb, prox in zip(mbs, backend.forward_logprobs(mbs), strict=True):
                mb.proximal_logprobs = prox
        backend.train_step(mbs, loss_fn)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            (mbs,) = pack_samples(batch, adv, backend.micro_batch_tokens)
            backend.train_step(mbs, loss_fn)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        args.profile.mkdir(parents=True, exist_ok=True)
        (args.profile / f"profile_{variant}.txt").write_text(table)
        prof.export_chrome_trace(str(args.profile / f"trace_{variant}.json.gz"))
    n_params = sum(t.numel() for bucket in backend.state_for_sync(1 << 40) for _, t in bucket)
    extra = " + separate proximal forward" if separate_proximal else ""
    return {
        "what": f"{cfg.train.backend} backend GRPO step{extra}: {' '.join(overrides) or 'defaults'}",
        "micro_batch_tokens": backend.micro_batch_tokens,
        "step_s": times,
        "params": n_params,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "backend": backend,
        "cfg": cfg,
    }


def check_varlen_matches_sdpa(path: Path, args: argparse.Namespace) -> dict:
    """The flash varlen path against the masked packed row on the same micro-batch."""
    from areal_sdk.algorithms.advantages import sample_advantages
    from areal_sdk.config import load_config
    from areal_sdk.packing import pack_samples
    from areal_sdk.plugin_host import get_host

    batch = samples(8, 512, 151936)
    (mbs,) = pack_samples(batch, sample_advantages(batch, "grpo"), 4096)
    out = []
    for attn in ("sdpa", "varlen"):
        cfg = load_config(
            None,
            [
                f"model.path={path}",
                "train.device=cuda",
                "train.bf16=true",
                f"train.attn_implementation={attn}",
            ],
        )
        backend = get_host().train_backend("torch")(cfg)
        out.append(torch.cat(backend.forward_logprobs(mbs)))
        del backend
        torch.cuda.empty_cache()
    diff = (out[0] - out[1]).abs()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}


def time_plain(path: Path, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    per_mb = max(1, (args.micro_batch_tokens or 16384) // args.seq_len)
    ids = torch.randint(0, 151936, (args.seqs, args.seq_len), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for chunk in ids.split(per_mb):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=chunk, labels=chunk).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "what": "plain loop: HF causal-LM loss, AdamW(fused), autocast bf16, grad ckpt",
        "step_s": times,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    del model, opt
    torch.cuda.empty_cache()
    return out


def time_pushes(path: Path, backend, cfg, repeats: int) -> list[dict]:  # type: ignore[no-untyped-def]
    from areal_sdk.backends.embedded.engine import EmbeddedEngine
    from areal_sdk.backends.weight_sync import make_weight_sync

    engine = EmbeddedEngine.from_pretrained(str(path), device="cuda", dtype="bfloat16")
    rows = []

    async def go() -> None:
        for method in ("in_process", "disk"):
            extra = {"directory": str(path.parent / "weights")} if method == "disk" else {}
            sync = make_weight_sync(method, cfg, engine=engine, **extra)
            times = []
            for v in range(repeats):
                t0 = time.perf_counter()
                await sync.push(backend.state_for_sync(256 << 20), 100 + v + len(rows) * 10)
                times.append(time.perf_counter() - t0)
            rows.append({"method": method, "push_s": times, "version": engine.version})
        await engine.close()

    asyncio.run(go())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="pinned for every variant but defaults (default: the backend sizes it)",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--logprob-backend", default="auto", help="auto | torch | triton")
    parser.add_argument(
        "--variants",
        default="sdpa_gc_prox,varlen_gc,varlen,padded",
        help=f"backend layouts to time, of: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--check", action="store_true", help="compare varlen with sdpa first")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile", type=Path, help="write each variant's kernel table (one step) to this folder"
    )
    args = parser.parse_args()
    path = build(Path(tempfile.mkdtemp(prefix="train-bench-")) / "model", args.layers)
    tokens = args.seqs * args.seq_len
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "tokens_per_step": tokens}
    if args.check:
        report["varlen_check"] = check_varlen_matches_sdpa(path, args)
        print(json.dumps({"varlen_check": report["varlen_check"]}), flush=True)
    rows = {"plain": time_plain(path, args)}
    print(json.dumps({"plain": rows["plain"]}), flush=True)
    backend = cfg = None
    n_params = None
    for name in args.variants.split(","):
        if backend is not None:
            backend.close()
            del backend
            torch.cuda.empty_cache()
        try:
            row = time_backend(path, args, name)
        except Exception as exc:  # one variant failing must not hide the others
            backend = None
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({name: rows[name]}), flush=True)
            continue
        backend, cfg = row.pop("backend"), row.pop("cfg")
        n_params = row["params"]
        rows[name] = row
        print(json.dumps({name: row}), flush=True)
    fpt = flops_per_token(n_params or 494_032_768, args.layers, 896, args.seq_len)
    for name, row in rows.items():
        if "step_s" not in row:
            report[name] = row
            continue
        best = min(row["step_s"][1:] or row["step_s"])
        row["tokens_per_s"] = tokens / best
        row["mfu"] = row["tokens_per_s"] * fpt / (args.peak_tflops * 1e12)
        report[name] = row
        print(
            f"{name:18s} {row['tokens_per_s']:10,.0f} tok/s  MFU {row['mfu']:.1%}  "
            f"peak {row['peak_mem_gib']:.1f} GiB",
            flush=True,
        )
    try:
        if backend is None or args.pushes < 1:
            raise RuntimeError("no backend left to push from")
        report["weight_push"] = time_pushes(path, backend, cfg, args.pushes)
    except Exception as exc:
        report["weight_push"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
