"""The two kernels of a training step outside the body GEMMs, timed alone on one GPU:
packed causal attention (forward + backward) and the fused logprob head, each variant
checked against a reference first.

Shapes are the ``train_throughput.py`` step: Qwen2-0.5B (14 query heads, 2 KV heads,
head_dim 64, hidden 896, vocabulary 151,936), one packed micro-batch of ``--tokens``.

    python benchmarks/train_step_parts.py --tokens 32768
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def bench(fn: Callable[[], object], reps: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after two warm-ups (device events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def attention(args: argparse.Namespace, lengths: list[int], label: str) -> list[dict]:
    from areal_sdk.backends.train import varlen_attention as va

    torch.manual_seed(0)
    n, hq, hk, d = sum(lengths), 14, 2, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.cuda()
    longest = max(lengths)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    scale = d**-0.5
    # causal FLOPs: 4 x sum(L^2 / 2) x heads x d forward, 2.5x that backward
    fwd_flops = sum(2 * length * length * hq * d for length in lengths)

    layout = va.padded_layout(cu, lengths, "cudnn")
    padding_cost = len(lengths) * longest**2 / sum(x * x for x in lengths)
    auto = va.padded_layout(cu, lengths, "auto") is not None
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "flash varlen": lambda: va.flash_varlen(q, k, v, cu, longest, scale),
        f"cuDNN padded batch (cost x{padding_cost:.2f}; auto takes it: {auto})": lambda: (
            va.padded_cudnn(q, k, v, *layout, scale)
        ),
    }
    if len(set(lengths)) == 1:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, s = len(lengths), lengths[0]

        def dense(backend: SDPBackend, gqa: bool) -> torch.Tensor:
            qd = q.view(b, s, hq, d).transpose(1, 2)
            kd, vd = (t.view(b, s, hk, d).transpose(1, 2) for t in (k, v))
            if not gqa:
                kd, vd = (t.repeat_interleave(hq // hk, dim=1) for t in (kd, vd))
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa
                )
            return out.transpose(1, 2).reshape(n, hq, d)

        impls["SDPA cuDNN, KV heads expanded"] = lambda: dense(SDPBackend.CUDNN_ATTENTION, False)
        impls["SDPA flash, padded batch"] = lambda: dense(SDPBackend.FLASH_ATTENTION, True)

    ref_out = ref_grads = None
    rows = []
    for name, fn in impls.items():
        row: dict = {"case": label, "impl": name}
        try:
            for t in (q, k, v):
                t.grad = None
            out = fn()
            out.backward(grad)
            grads = [t.grad.clone() for t in (q, k, v)]
            if ref_out is None:
                ref_out, ref_grads = out.detach(), grads
            else:
                row["out_err"] = rel(out, ref_out)
                row["grad_err"] = max(rel(g, r) for g, r in zip(grads, ref_grads, strict=True))
            row["fwd_ms"] = bench(lambda fn=fn: fn())
            row["fwd_bwd_ms"] = bench(lambda fn=fn: fn().backward(grad))
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 2.5 * fwd_flops / (row["fwd_bwd_ms"] - row["fwd_ms"]) / 1e9
        except Exception as exc:  # a backend missing on this build must not hide the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def head(args: argparse.Namespace) -> list[dict]:
    from areal_sdk.kernels import fused_logprobs

    kernels = {"": fused_logprobs}
    if args.baseline_kernel:
        spec = importlib.util.spec_from_file_location("baseline_kernel", args.baseline_kernel)
        assert spec is not None and spec.loader is not None
        kernels = {"baseline ": importlib.util.module_from_spec(spec), **kernels}
        sys.modules["baseline_kernel"] = kernels["baseline "]  # for its dataclasses
        spec.loader.exec_module(kernels["baseline "])

    torch.manual_seed(0)
    n, h, vocab = args.tokens, 896, 151936
    hidden = (torch.randn(n, h, device="cuda") * 1.0).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, h, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    # Reference on the first 2,048 rows: float32 logits from the bf16 operands.
    r = slice(0, 2048)
    hr, wr = hidden[r].detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    logp = torch.log_softmax(hr @ wr.T, -1)
    ref_lp = logp.gather(1, labels[r, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((ref_lp * g_lp[r]).sum() + (ref_ent * g_ent[r]).sum()).backward()
    ref = (ref_lp.detach(), ref_ent.detach(), hr.grad, wr.grad)
    del logp

    fl = fused_logprobs

    def run(chunk: int, backward: bool) -> tuple[torch.Tensor, ...]:
        hidden.grad = weight.grad = None
        lp, ent = fl.fused_logprobs_and_entropy(hidden, weight, labels, chunk_size=chunk)
        if backward:
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp, ent

    def check(chunk: int) -> dict:
        # The reference's dW only sees 2,048 rows: compare on those rows alone.
        hidden.grad = weight.grad = None
        lp, ent = fl.fused_logprobs_and_entropy(hidden[r], weight, labels[r], chunk_size=chunk)
        ((lp * g_lp[r]).sum() + (ent * g_ent[r]).sum()).backward()
        return {
            "lp_err": rel(lp, ref[0]),
            "ent_err": rel(ent, ref[1]),
            "dh_err": rel(hidden.grad[r], ref[2]),
            "dw_err": rel(weight.grad, ref[3]),
        }

    rows = []
    settings = ("FORWARD_CONFIG", "BACKWARD_CONFIG", "HOPPER_BACKWARD_CONFIG")
    shipped = {key: getattr(fl, key) for key in (*settings, "BACKWARD_CHUNK_BYTES")}
    base_fwd, base_bwd = fl.FORWARD_CONFIG, fl._backward_config(hidden.device)
    cases = [("chunk 1024", base_fwd, base_bwd, 1024)]
    if "baseline " in kernels:
        old = kernels["baseline "]
        cases.insert(0, ("baseline chunk 1024", old.FORWARD_CONFIG, old.BACKWARD_CONFIG, 1024))
    for chunk in args.chunks:
        cases.append((f"chunk {chunk}", base_fwd, base_bwd, chunk))
    for tile in args.fwd_tiles:
        cases.append((f"fwd tile {tile}", fl.TileConfig(*tile), base_bwd, args.chunks[-1]))
    for tile in args.bwd_tiles:
        cases.append((f"dz tile {tile}", base_fwd, fl.TileConfig(*tile), args.chunks[-1]))
    cases.append(("default backward chunks (BACKWARD_CHUNK_BYTES)", base_fwd, base_bwd, 1024))
    flops = 2 * n * h * vocab
    for name, fwd_cfg, bwd_cfg, chunk in cases:
        fl = kernels["baseline "] if name.startswith("baseline") else fused_logprobs
        fl.FORWARD_CONFIG, fl.BACKWARD_CONFIG = fwd_cfg, bwd_cfg
        fl.HOPPER_BACKWARD_CONFIG = bwd_cfg
        # Backward chunks of exactly ``chunk`` rows, except in the row that times the default.
        fl.BACKWARD_CHUNK_BYTES = (
            shipped["BACKWARD_CHUNK_BYTES"] if name.startswith("default") else 0
        )
        row: dict = {"case": name, "chunk": chunk}
        try:
            row.update(check(chunk))
            row["fwd_ms"] = bench(lambda chunk=chunk: run(chunk, False))
            row["fwd_bwd_ms"] = bench(lambda chunk=chunk: run(chunk, True))
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.reset_peak_memory_stats()
        rows.append(row)
        print(json.dumps(row), flush=True)
    for key, value in shipped.items():
        setattr(fused_logprobs, key, value)
    return rows


def projections(args: argparse.Namespace) -> list[dict]:
    """A decoder layer's input projections, forward + backward: q, k, v, gate and up as five
    GEMMs (the HF modules) against two over concatenated weights, float32 master weights
    under bf16 autocast as the trainer runs them."""
    torch.manual_seed(0)
    n, h, inter, kv = args.tokens, 896, 4864, 128
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    shapes = {"q": h, "k": kv, "v": kv, "gate": inter, "up": inter}
    ws = {k: (torch.randn(o, h, device="cuda") * 0.02).requires_grad_() for k, o in shapes.items()}
    grads = {k: torch.randn(n, o, device="cuda", dtype=torch.bfloat16) for k, o in shapes.items()}

    def separate() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = [torch.nn.functional.linear(x, ws[k]) for k in shapes]
        torch.autograd.backward(outs, [grads[k] for k in shapes])

    def fused() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            qkv = torch.nn.functional.linear(x, torch.cat([ws["q"], ws["k"], ws["v"]]))
            gu = torch.nn.functional.linear(x, torch.cat([ws["gate"], ws["up"]]))
        torch.autograd.backward(
            [qkv, gu],
            [
                torch.cat([grads[k] for k in ("q", "k", "v")], 1),
                torch.cat([grads["gate"], grads["up"]], 1),
            ],
        )

    flops = 6 * n * h * sum(shapes.values())
    rows = []
    for name, fn in (("five GEMMs", separate), ("two concatenated", fused)):
        ms = bench(fn)
        row = {"case": name, "fwd_bwd_ms": ms, "tflops": flops / ms / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def head_stored(args: argparse.Namespace) -> list[dict]:
    """The logprob head keeping the softmax for backward (``train.logprob_backend: stored``)
    against the fused Triton head that recomputes the logits, logprobs' gradient only."""
    from areal_sdk.kernels import fused_logprobs as fl
    from areal_sdk.kernels.stored_softmax import stored_softmax_logprobs

    torch.manual_seed(0)
    n, h, vocab = args.tokens, 896, 151936
    hidden = torch.randn(n, h, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, h, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    g_lp = torch.randn(n, device="cuda")
    heads = {
        "fused Triton, recomputing": fl.fused_logprobs_and_entropy,
        "stored softmax": stored_softmax_logprobs,
    }

    def run(name: str, backward: bool) -> torch.Tensor:
        hidden.grad = weight.grad = None
        lp, _ = heads[name](hidden, weight, labels, with_entropy=False)
        if backward:
            (lp * g_lp).sum().backward()
        return lp

    ref = (run("fused Triton, recomputing", True).detach(), hidden.grad, weight.grad)
    lp = run("stored softmax", True).detach()
    check = {
        "lp_err": rel(lp, ref[0]),
        "dh_err": rel(hidden.grad, ref[1]),
        "dw_err": rel(weight.grad, ref[2]),
    }
    rows = []
    for name in heads:
        torch.cuda.reset_peak_memory_stats()
        row = {
            "case": name,
            "fwd_ms": bench(lambda name=name: run(name, False)),
            "fwd_bwd_ms": bench(lambda name=name: run(name, True)),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            **(check if name == "stored softmax" else {}),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def mixed_lengths(total: int, low: int, high: int) -> list[int]:
    """Lengths drawn uniformly from [low, high] (seeded) until they fill ``total`` tokens."""
    gen = torch.Generator().manual_seed(1)
    lengths: list[int] = []
    while sum(lengths) + high <= total:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=gen)))
    if total > sum(lengths):
        lengths.append(total - sum(lengths))
    return lengths


def tile(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[4096])
    parser.add_argument("--fwd-tiles", type=lambda s: [tile(t) for t in s.split(";")], default=[])
    parser.add_argument("--bwd-tiles", type=lambda s: [tile(t) for t in s.split(";")], default=[])
    parser.add_argument("--skip", default="", help="attention,head,projections,head_stored")
    parser.add_argument(
        "--baseline-kernel", type=Path, help="another fused_logprobs.py to time beside this one"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "attention" not in args.skip:
        report["attention"] = []
        for low, high in ((2048, 2048), (1536, 2048), (1024, 2048), (64, 4096)):
            lengths = mixed_lengths(args.tokens, low, high)
            label = f"{len(lengths)} seqs of {min(lengths)}-{max(lengths)}"
            report["attention"] += attention(args, lengths, label)
    if "head" not in args.skip:
        report["head"] = head(args)
    if "projections" not in args.skip:
        report["projections"] = projections(args)
    if "head_stored" not in args.skip:
        report["head_stored"] = head_stored(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    for section in ("attention", "head", "projections", "head_stored"):
        for row in report.get(section, []):
            print(
                section,
                " | ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                ),
            )


if __name__ == "__main__":
    main()
