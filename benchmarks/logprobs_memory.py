"""Peak memory and time of per-token logprobs + entropy: naive vs chunked torch vs Triton.

Forward + backward of ``(lp * a).sum() + (entropy * b).sum()`` at the Qwen2-0.5B head shape
(T=16384 tokens, H=896, V=151936, bf16) on a GPU, or a smaller shape on the CPU. Also
checks each variant against a float32 reference (logits from upcast inputs) and, with
``--sweep``, times a few Triton tile configurations.

    python benchmarks/logprobs_memory.py --device cuda --sweep --json out.json
    python benchmarks/logprobs_memory.py --device cpu --tokens 1024 --hidden 256 --vocab 32000

Results: benchmarks/logprobs.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from areal_sdk.logprobs import token_logprobs_and_entropy


def naive(hidden, weight, labels, temperature=1.0, **_: Any):
    """What a trainer writes without thinking: full [T, V] float32 logits."""
    logits = (hidden @ weight.T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, labels[:, None]).squeeze(1), entropy


VARIANTS = {
    "naive": naive,
    "chunked": partial(token_logprobs_and_entropy, backend="torch"),
    "triton": partial(token_logprobs_and_entropy, backend="triton"),
}


def make_inputs(t, h, v, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Scales like a trained head: logits of a few units, entropy of a few nats.
    hidden = torch.randn(t, h, generator=g).mul_(3.0).to(device, dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).div_(h**0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g).to(device)
    a = torch.randn(t, generator=g).to(device)
    b = torch.randn(t, generator=g).to(device)
    return hidden, weight, labels, a, b


def step(fn, inputs, **kw):
    hidden, weight, labels, a, b = inputs
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, labels, **kw)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach()


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp(min=1e-30))


def reference(inputs, temperature):
    """float32 logits from upcast inputs (no TF32): the yardstick for every variant."""
    hidden, weight, labels, a, b = inputs
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    lp, ent = step(naive, (h32, w32, labels, a, b), temperature=temperature)
    out = {"lp": lp, "ent": ent, "gh": h32.grad.float(), "gw": w32.grad.float()}
    del h32, w32
    return out


def measure_cuda(name, inputs, ref, iters, **kw) -> dict[str, Any]:
    fn = VARIANTS[name]
    hidden, weight = inputs[0], inputs[1]
    step(fn, inputs, **kw)  # warm-up: Triton compiles here
    torch.cuda.synchronize()
    hidden.grad = weight.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fn(*inputs[:3], **kw)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    lp, ent = step(fn, inputs, **kw)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    errors = {
        "lp_rel_err": rel(lp, ref["lp"]),
        "lp_max_abs_err": float((lp - ref["lp"]).abs().max()),
        "entropy_rel_err": rel(ent, ref["ent"]),
        "grad_hidden_rel_err": rel(hidden.grad, ref["gh"]),
        "grad_weight_rel_err": rel(weight.grad, ref["gw"]),
        "finite": bool(torch.isfinite(lp).all() and torch.isfinite(hidden.grad).all()),
    }
    times, fwd_times = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(fn, inputs, **kw)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        start.record()
        with torch.no_grad():
            fn(*inputs[:3], **kw)
        end.record()
        torch.cuda.synchronize()
        fwd_times.append(start.elapsed_time(end))
    hidden.grad = weight.grad = None
    return {
        "variant": name,
        **{k: v for k, v in kw.items() if k != "temperature"},
        "fwd_bwd_ms": statistics.median(times),
        "fwd_ms": statistics.median(fwd_times),
        "fwd_bwd_peak_gib": peak / 2**30,
        "fwd_peak_gib": fwd_peak / 2**30,
        **errors,
    }


def sweep_triton(inputs, ref) -> list[dict[str, Any]]:
    """Time the forward kernel and the backward grad-logits kernel over a few tile shapes."""
    import triton.testing

    from areal_sdk.kernels import fused_logprobs as fl

    hidden, weight, labels = (x.detach() for x in inputs[:3])
    rows = []
    fwd_default, bwd_default = fl.FORWARD_CONFIG, fl.BACKWARD_CONFIG
    shapes = [
        (128, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 256, 64, 8, 3),
        (128, 128, 32, 8, 4),
        (64, 128, 64, 4, 3),
        (128, 128, 64, 4, 4),
    ]
    for kind in ("forward", "backward"):
        for shape in shapes:
            cfg = fl.TileConfig(*shape)
            try:
                if kind == "forward":
                    fl.FORWARD_CONFIG = cfg
                    fn = partial(fl._forward_stats, hidden, weight, labels, 1.0)
                    lse, label_z, ent = fn()
                    err = rel(label_z - lse, ref["lp"])
                else:
                    fl.BACKWARD_CONFIG = cfg
                    lse = torch.logsumexp((hidden[:4096].float() @ weight.float().T), -1)
                    ent = torch.zeros_like(lse)
                    g = torch.ones_like(lse)
                    fn = partial(
                        fl._grad_logits, hidden[:4096], weight, labels[:4096], lse, ent, g, g, 1.0
                    )
                    fn()
                    err = float("nan")
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                rows.append({"kernel": kind, "tile": shape, "ms": ms, "lp_rel_err": err})
            except Exception as exc:  # a tile too big for shared memory: report and go on
                rows.append(
                    {"kernel": kind, "tile": shape, "error": f"{type(exc).__name__}: {exc}"[:200]}
                )
            print(rows[-1], flush=True)
    fl.FORWARD_CONFIG, fl.BACKWARD_CONFIG = fwd_default, bwd_default
    return rows


def run_cuda(args) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    inputs = make_inputs(args.tokens, args.hidden, args.vocab, torch.bfloat16, "cuda")
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": [args.tokens, args.hidden, args.vocab],
        "dtype": "bfloat16",
        "temperature": args.temperature,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    ref = reference(inputs, args.temperature)
    torch.cuda.empty_cache()
    rows = []
    for name in args.variants:
        chunks = args.chunks if name != "naive" else [None]
        for chunk in chunks:
            kw = {"temperature": args.temperature}
            if chunk is not None:
                kw["chunk_size"] = chunk
            try:
                rows.append(measure_cuda(name, inputs, ref, args.iters, **kw))
            except torch.OutOfMemoryError as exc:
                rows.append({"variant": name, "chunk_size": chunk, "error": f"OOM: {exc}"[:200]})
            torch.cuda.empty_cache()
            print(rows[-1], flush=True)
    sweep = sweep_triton(inputs, ref) if args.sweep and "triton" in args.variants else []
    return {"info": info, "results": rows, "sweep": sweep}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_child(args) -> None:
    """One variant in a fresh process, so the peak RSS is this variant's alone."""
    inputs = make_inputs(args.tokens, args.hidden, args.vocab, torch.float32, "cpu")
    kw = {"temperature": args.temperature}
    if args.child != "naive":
        kw["chunk_size"] = args.chunks[0]
    before = _rss_mib()  # interpreter + torch + inputs
    times = []
    for _ in range(args.iters + 1):
        t0 = time.perf_counter()
        step(VARIANTS[args.child], inputs, **kw)
        times.append((time.perf_counter() - t0) * 1000)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "variant": args.child,
        **kw,
        "fwd_bwd_ms": statistics.median(times[1:]),  # the first run warms the allocator up
        "rss_before_mib": before,
        "extra_peak_mib": peak - before,
    }
    print(json.dumps(result))


def run_cpu(args) -> dict[str, Any]:
    rows = []
    for name in ("naive", "chunked"):
        cmd = [
            sys.executable,
            __file__,
            "--device",
            "cpu",
            "--child",
            name,
            "--tokens",
            str(args.tokens),
            "--hidden",
            str(args.hidden),
            "--vocab",
            str(args.vocab),
            "--iters",
            str(args.iters),
            "--chunks",
            str(args.chunks[0]),
            "--temperature",
            str(args.temperature),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    # Inputs + grads alone, for the baseline the peaks include.
    t, h, v = args.tokens, args.hidden, args.vocab
    info = {
        "shape": [t, h, v],
        "dtype": "float32",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "inputs_and_grads_mib": 2 * 4 * (t * h + v * h) / 2**20,
        "one_fp32_logits_copy_mib": 4 * t * v / 2**20,
    }
    return {"info": info, "results": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1024])
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--sweep", action="store_true", help="time Triton tile configurations")
    p.add_argument("--json", type=Path, help="write results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _cpu_child(args)
        return
    result = run_cuda(args) if args.device == "cuda" else run_cpu(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.device == "cpu":
        print("\nvariant   chunk  fwd+bwd ms  extra peak RSS MiB")
        for r in result["results"]:
            chunk = r.get("chunk_size", "-")
            print(
                f"{r['variant']:9} {chunk!s:6} {r['fwd_bwd_ms']:10.1f} {r['extra_peak_mib']:19.1f}"
            )
        return
    print("\nvariant   chunk  fwd+bwd ms  fwd ms  peak fwd+bwd GiB  peak fwd GiB  lp rel err")
    for r in result["results"]:
        if "error" in r:
            print(f"{r['variant']:9} {r.get('chunk_size')!s:6} {r['error']}")
            continue
        print(
            f"{r['variant']:9} {r.get('chunk_size', '-')!s:6} {r['fwd_bwd_ms']:10.1f} "
            f"{r['fwd_ms']:7.1f} {r['fwd_bwd_peak_gib']:17.3f} {r['fwd_peak_gib']:13.3f}  "
            f"{r['lp_rel_err']:.2e}"
        )


if __name__ == "__main__":
    main()
