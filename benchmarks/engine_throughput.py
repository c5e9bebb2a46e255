"""Output tokens/s of the embedded engine against plain ``model.generate``, same model/batch.

Runs on CPU (the tiny test model, SmolLM2-135M from the registry) or CUDA (a 0.5B
Qwen2-shaped model with random weights, built from a config: no hub). Every request has a
random prompt of ``--prompt-len`` tokens and samples exactly ``--new-tokens`` tokens
(temperature 1, EOS ignored), so both sides produce the same number of tokens.

    python benchmarks/engine_throughput.py --model tiny --device cpu --concurrency 1,4,16
    python benchmarks/engine_throughput.py --model smollm2 --device cpu --concurrency 16
    python benchmarks/engine_throughput.py --model qwen0.5b --device cuda --concurrency 1,32,256 \
        --new-tokens 256 --hf-batch 256 --weight-update

Prints one JSON object per measurement and, with ``--json PATH``, writes them all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from areal_sdk.compute_threads import call_in_fresh_thread  # noqa: E402
from benchmarks.shapes import QWEN2_05B  # noqa: E402

QWEN_05B = {**QWEN2_05B, "max_position_embeddings": 4096}


def build_model(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer-or-None) for ``name``: tiny | smollm2 | qwen0.5b."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if name == "tiny":
        from tests.tiny_model import build_tiny_model

        path = build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-")), None)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if name == "smollm2":
        from areal_sdk.models import load_model

        return load_model(
            "smollm2-135m-instruct", device=device, dtype=str(dtype).split(".")[-1]
        ).model
    if name == "qwen0.5b":
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).to(dtype)
        return model.eval()
    raise SystemExit(f"unknown model {name!r}")


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=gen).tolist()


def bench_engine(
    model,
    args,
    concurrency: int,
    graphs: bool | None = None,
    packed: bool | None = None,
    fused: bool | None = None,
    flash_decode: bool | None = None,
    variant_suffix: str = "",
    overlap: bool | None = None,
) -> dict:
    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

    from areal_sdk.inference import SamplingParams

    # Built on a thread of its own: allocating the cache runs torch on the building thread,
    # and this one stays alive while the engine's thread computes.
    engine = call_in_fresh_thread(
        EmbeddedEngine,
        model,
        None,
        config=EngineConfig(
            max_batch_size=concurrency,
            max_model_len=args.prompt_len + args.new_tokens + 8,
            prefill_chunk=args.prefill_chunk,
            cuda_graphs=graphs,
            packed_weights=packed,
            fused_decoder=fused,
            flash_decode=flash_decode,
            overlap_decode=overlap,
        ),
    )
    # Read now: close() gives the model its own layers back.
    fused_on, flash_on = engine.runner.fused is not None, engine.runner.flash_decode
    overlap_on = engine.overlap_decode
    vocab = engine.vocab_size
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    captured = engine.runner.capture_graphs()

    async def run(batch: list[list[int]], s: SamplingParams) -> float:
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, s) for p in batch))
        elapsed = time.perf_counter() - start
        assert all(len(o.output_ids) == s.max_new_tokens for o in outs)
        return elapsed

    async def main() -> float:
        await run(
            prompts(concurrency, args.prompt_len, vocab, 1),
            sampling.model_copy(update={"max_new_tokens": 4}),
        )
        elapsed = await run(prompts(concurrency, args.prompt_len, vocab), sampling)
        await engine.close()
        return elapsed

    elapsed = asyncio.run(main())
    tokens = concurrency * args.new_tokens
    variant = "engine" + variant_suffix
    if graphs is False:
        variant += "_eager"
    if packed is False:
        variant += "_unpacked"
    if fused is not None:
        variant += "_fused" if fused else "_hf_layers"
    if flash_decode is not None:
        variant += "_flash_decode" if flash_decode else "_sdpa_decode"
    return {
        "variant": variant,
        "fused_decoder": fused_on,
        "flash_decode": flash_on,
        "overlap_decode": overlap_on,
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "cuda_graphs": captured,
        "graph_error": engine.runner.graph_error,
    }


def bench_hf_generate(model, args, batch: int) -> dict:
    """Plain ``model.generate`` with the model's default attention and DynamicCache."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(
        prompts(batch, args.prompt_len, model.config.vocab_size), device=model.device
    )
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_new_tokens=args.new_tokens,
        max_new_tokens=args.new_tokens,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    with torch.inference_mode():
        model.generate(ids[:, :16], **{**kwargs, "min_new_tokens": 2, "max_new_tokens": 2})
        sync(model)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        sync(model)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * batch
    return {
        "variant": "hf_generate",
        "concurrency": batch,
        "seconds": round(elapsed, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def bench_hf_continuous(model, args, batch: int) -> dict:
    """transformers' own continuous batching (``generate_batch``), for the record."""
    from transformers import GenerationConfig

    inputs = prompts(batch, args.prompt_len, model.config.vocab_size)
    new = min(args.new_tokens, args.hf_cb_tokens)
    config = GenerationConfig(
        max_new_tokens=new,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=-1,
        pad_token_id=0,
    )
    try:
        # No inference_mode here: generate_batch runs its own thread, which fails on
        # inference tensors created outside it.
        model.generate_batch(inputs=inputs[:4], generation_config=config, progress_bar=False)
        sync(model)
        start = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
        sync(model)
    except Exception as exc:  # record why it could not run
        return {"variant": "hf_generate_batch", "concurrency": batch, "error": repr(exc)[:300]}
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in out.values())
    return {
        "variant": "hf_generate_batch",
        "concurrency": batch,
        "seconds": round(elapsed, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def check_flash_decode(device: str) -> dict:
    """The flash decode attention against SDPA per row, bf16, over a random slot cache."""
    from areal_sdk.backends.embedded.kv_cache import flash_decode

    g = torch.Generator(device=device).manual_seed(0)
    slots, kv_heads, heads, positions, dim = 8, 2, 14, 65, 64
    shape = (slots, kv_heads, positions, dim)
    keys = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    values = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    query = torch.randn(6, heads, dim, generator=g, device=device, dtype=torch.bfloat16)
    lengths = torch.tensor([1, 5, 64, 33, 17, 2], device=device)
    out = flash_decode(query, keys, values, lengths, 64, dim**-0.5).float()
    worst = 0.0
    for r, n in enumerate(lengths.tolist()):
        k = keys[r, :, :n].float().repeat_interleave(heads // kv_heads, 0)
        v = values[r, :, :n].float().repeat_interleave(heads // kv_heads, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(
            query[r].float().unsqueeze(1), k, v, scale=dim**-0.5
        ).squeeze(1)
        worst = max(worst, float((ref - out[r]).abs().max()))
    return {"variant": "check_flash_decode", "max_abs_err_vs_sdpa_fp32": worst}


def check(device: str, fused: bool | None = None) -> dict:
    """Correctness where the benchmark runs: float32 tiny model, CUDA graphs on for CUDA.

    Greedy output under continuous batching equals HF ``generate`` run alone; logprobs equal
    a full forward pass; a seeded request draws the same tokens alone and in a batch; after a
    weight update the decode graphs captured before it generate with the new weights.
    """
    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

    from areal_sdk.inference import SamplingParams

    model = build_model("tiny", device, torch.float32)
    ref = build_model("tiny", device, torch.float32)
    ref.load_state_dict(model.state_dict())
    # Lengths 5..215 (+24 new): decode graphs of the 128 and 256 cache-length buckets.
    engine = EmbeddedEngine(
        model, None, config=EngineConfig(max_batch_size=8, max_model_len=512, fused_decoder=fused)
    )
    fused_on = engine.runner.fused is not None  # close() gives the model its layers back
    base = prompts(1, 240, engine.vocab_size, 3)[0]
    batch = [base[: 5 + 30 * i] for i in range(8)]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)

    g = torch.Generator().manual_seed(5)
    update = {
        name: (p.detach().cpu() + torch.randn(p.shape, generator=g) * 0.02).to(device)
        for name, p in ref.named_parameters()
    }

    async def main():
        together = await asyncio.gather(*(engine.generate(p, greedy) for p in batch))
        s_batch = await asyncio.gather(*(engine.generate(p, seeded) for p in batch))
        s_alone = await engine.generate(batch[5], seeded)
        await engine.update_weights(update, 1)
        updated = await asyncio.gather(*(engine.generate(p, greedy) for p in batch))
        await engine.close()
        return together, s_batch, s_alone, updated

    together, s_batch, s_alone, updated = asyncio.run(main())
    ref.set_attn_implementation("sdpa")

    def agreement(outs) -> tuple[int, float]:
        greedy_ok, worst = 0, 0.0
        with torch.inference_mode():
            for p, out in zip(batch, outs, strict=True):
                ids = torch.tensor([p], device=device)
                hf = ref.generate(
                    ids, max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0
                )
                greedy_ok += hf[0, len(p) :].tolist() == out.output_ids
                full = torch.tensor([p + out.output_ids], device=device)
                lp = torch.log_softmax(ref(full).logits[0].float(), dim=-1)
                picked = full[0, len(p) :].view(-1, 1)
                want = lp[len(p) - 1 : -1].gather(1, picked).view(-1).tolist()
                err = max(abs(a - b) for a, b in zip(want, out.logprobs, strict=True))
                worst = max(worst, err)
        return greedy_ok, worst

    greedy_ok, worst = agreement(together)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(update[name])
    greedy_after, worst_after = agreement(updated)
    return {
        "variant": "check" if fused is None else f"check_fused_{fused}",
        "fused_decoder": fused_on,
        "device": device,
        "cuda_graphs": len(engine.runner._graphs),
        "graph_error": engine.runner.graph_error,
        "greedy_equal_hf": f"{greedy_ok}/8",
        "max_logprob_abs_err": worst,
        "seeded_batch_equals_alone": s_batch[5].output_ids == s_alone.output_ids,
        "greedy_equal_hf_after_update": f"{greedy_after}/8",
        "max_logprob_abs_err_after_update": worst_after,
    }


def profile_step(
    model, args, rows: int, fused: bool | None = None, flash_decode: bool = False
) -> dict:
    """Where one decode step's time goes at ``rows`` rows: forward, sampling, host work; with
    ``args.kernels``, the eager step's kernels by device time."""
    from areal_sdk.backends.embedded.model_runner import ModelRunner
    from areal_sdk.backends.embedded.sampler import SamplingBatch, sample

    max_len = args.prompt_len + args.new_tokens + 8
    runner = ModelRunner(
        model, num_slots=rows, max_len=max_len, fused_decoder=fused, flash_decode=flash_decode
    )
    runner.capture_graphs()
    slots, pos, toks = (
        list(range(rows)),
        [args.prompt_len + args.new_tokens // 2] * rows,
        [11] * rows,
    )

    def timed(fn, n=30) -> float:
        fn()
        sync(model)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync(model)
        return (time.perf_counter() - start) / n * 1000

    logits = runner.decode(slots, pos, toks)
    params = lambda: SamplingBatch.build([(1.0, -1, 1.0, 0.0, None, 0)] * rows, runner.device)  # noqa: E731
    batch = params()
    out = {
        "variant": "profile",
        "fused_decoder": runner.fused is not None,
        "flash_decode": runner.flash_decode,
        "cuda_graphs": len(runner._graphs),
        "graph_error": runner.graph_error,
        "rows": rows,
        "decode_forward_ms": round(timed(lambda: runner.decode(slots, pos, toks)), 3),
        # What the engine's decode step runs: inputs in, one replay (forward and sampling),
        # tokens and logprobs out.
        "decode_sampled_ms": round(
            timed(lambda: runner.decode_sampled(slots, pos, toks, [1.0] * rows)), 3
        ),
        "sample_ms": round(timed(lambda: sample(logits, batch)), 3),
        "sampling_params_build_ms": round(timed(params), 3),
        "tolist_ms": round(timed(lambda: sample(logits, batch).tokens.tolist()), 3),
    }
    if args.kernels and args.device.startswith("cuda"):
        out["kernels"] = kernel_table(lambda: runner.decode(slots, pos, toks), runner)
    runner.drop_graphs()
    runner.release_model()
    return out


def kernel_table(step, runner, top: int = 12) -> list[str]:
    """The eager decode step's kernels by total device time (graphs hide them)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, runner._graph_buckets = runner._graph_buckets, []
    try:
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    finally:
        runner._graph_buckets = graphs
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 5
    rows = [f"total {total / 1000:.3f} ms a step, {sum(e.count for e in events) // 5} kernels"]
    for e in events[:top]:
        rows.append(f"{e.device_time_total / 5000:7.3f} ms {e.count // 5:4d}x {e.key[:90]}")
    return rows


def bench_weight_update(model) -> list[dict]:
    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

    # Taken before the engine: on CPU its packed copies replace the model's weights.
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = EmbeddedEngine(model, None, config=EngineConfig(max_batch_size=1, max_model_len=64))
    results = []

    async def timed(source, version) -> float:
        start = time.perf_counter()
        await engine.update_weights(source, version)
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_model

        save_model(model, str(Path(tmp) / "model.safetensors"))
        size = sum(t.numel() * t.element_size() for t in tensors.values())

        async def main():
            await timed(tensors, 1)  # warm
            t_mem = await timed(tensors, 2)
            t_disk = await timed(tmp, 3)
            await engine.close()
            return t_mem, t_disk

        t_mem, t_disk = asyncio.run(main())
    results.append(
        {"variant": "update_weights_in_process", "seconds": round(t_mem, 4), "bytes": size}
    )
    results.append(
        {"variant": "update_weights_from_disk", "seconds": round(t_disk, 4), "bytes": size}
    )
    return results


def sync(model) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def torch_sampler() -> Iterator[None]:
    """Sample with the torch ops (the path CPUs and GPUs without triton take) meanwhile."""
    from areal_sdk.backends.embedded import sampler

    fused = sampler._fused_sampling
    sampler._fused_sampling = lambda logits: None
    try:
        yield
    finally:
        sampler._fused_sampling = fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2", "qwen0.5b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument(
        "--hf-batch", default="16", help="batch sizes for plain generate ('' skips)"
    )
    parser.add_argument(
        "--hf-cb", action="store_true", help="also time transformers' generate_batch"
    )
    parser.add_argument("--hf-cb-tokens", type=int, default=64)
    parser.add_argument("--weight-update", action="store_true")
    parser.add_argument("--profile", action="store_true", help="time the parts of a decode step")
    parser.add_argument(
        "--kernels", action="store_true", help="--profile: also the decode step's kernel table"
    )
    parser.add_argument(
        "--old-defaults-too",
        action="store_true",
        help="also the top level with the transformers layers and masked SDPA decode (the "
        "CUDA defaults before the fused decoder and flash decode)",
    )
    parser.add_argument(
        "--eager-too", action="store_true", help="also the top level without graphs"
    )
    parser.add_argument(
        "--unpacked-too",
        action="store_true",
        help="also the top level with plain weights (no oneDNN prepacking on CPU)",
    )
    parser.add_argument("--check", action="store_true", help="first check correctness on --device")
    parser.add_argument(
        "--fused-too",
        action="store_true",
        help="also the top level with the fused decoder forward (compiled parts on CUDA)",
    )
    parser.add_argument(
        "--flash-decode-too",
        action="store_true",
        help="also the top level with flash decode attention (default: masked SDPA)",
    )
    parser.add_argument(
        "--no-overlap-too",
        action="store_true",
        help="also the top level reading each decode step's tokens before queuing the next "
        "(EngineConfig.overlap_decode off)",
    )
    parser.add_argument(
        "--torch-sampler-too",
        action="store_true",
        help="also the top level sampling with torch ops instead of the one-pass Triton kernel "
        "(areal_sdk.kernels.fused_sampling, the CUDA default)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    if args.prefill_chunk is None:
        args.prefill_chunk = 8192 if args.device.startswith("cuda") else 2048
    # Every measurement, and the model load, on a thread that exits when done: a CPU thread
    # that has run torch keeps an OpenMP team, and two live teams slow both down
    # (areal_sdk/compute_threads.py); the engine's own thread is then the only one computing.
    model = call_in_fresh_thread(build_model, args.model, args.device, dtype)
    header = {
        "model": args.model,
        "device": args.device,
        "dtype": str(dtype),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.device.startswith("cuda"):
        header["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(header), flush=True)
    results: list[dict] = []

    def part(fn, *a, **kw) -> None:
        """Run one measurement; a failure is recorded and the others still run."""
        try:
            got = call_in_fresh_thread(fn, *a, **kw)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            got = {"variant": getattr(fn, "__name__", "?"), "error": repr(exc)[:400]}
        for item in got if isinstance(got, list) else [got]:
            results.append(item)
            print(json.dumps(item), flush=True)

    if args.check:
        part(check, args.device)
        if args.fused_too:
            part(check, args.device, fused=True)
        if args.device.startswith("cuda"):
            part(check_flash_decode, args.device)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    for c in levels:
        part(bench_engine, model, args, c)
    if args.eager_too and levels:
        part(bench_engine, model, args, levels[-1], graphs=False)
    if args.fused_too and levels:
        for c in levels:
            part(bench_engine, model, args, c, fused=True)
    if args.flash_decode_too and levels:
        part(bench_engine, model, args, levels[-1], flash_decode=True)
        if args.fused_too:
            part(bench_engine, model, args, levels[-1], fused=True, flash_decode=True)
    if args.old_defaults_too and levels:
        part(bench_engine, model, args, levels[-1], fused=False, flash_decode=False)
    if args.unpacked_too and levels:
        part(bench_engine, model, args, levels[-1], packed=False)
    if args.no_overlap_too and levels:
        part(bench_engine, model, args, levels[-1], overlap=False, variant_suffix="_no_overlap")
    if args.torch_sampler_too and levels:
        with torch_sampler():
            part(bench_engine, model, args, levels[-1], variant_suffix="_torch_sampler")
    if args.profile and levels:
        part(profile_step, model, args, levels[-1])
        if args.flash_decode_too:
            part(profile_step, model, args, levels[-1], flash_decode=True)
        if args.fused_too:
            part(profile_step, model, args, levels[-1], fused=True)
        if args.fused_too and args.flash_decode_too:
            part(profile_step, model, args, levels[-1], fused=True, flash_decode=True)
    if args.weight_update:
        part(bench_weight_update, model)
    batches = [int(x) for x in args.hf_batch.split(",") if x]
    for b in batches:
        part(bench_hf_generate, model, args, b)
    if args.hf_cb:
        for b in batches:
            part(bench_hf_continuous, model, args, b)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=2))


if __name__ == "__main__":
    main()
