"""``areal-sdk engine``: serve a model with the embedded engine on SGLang's native routes."""

from __future__ import annotations

import argparse
import os
import signal
import time

from areal_sdk.cli._common import console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "engine",
        help="serve a model over SGLang's HTTP API with the embedded engine",
        description=(
            "Load MODEL (a local HF directory, a .gguf file, or a registry name such as "
            "smollm2-135m-instruct) and serve /generate, /update_weights_from_disk, "
            "/pause_generation, ... with SGLang's JSON shapes."
        ),
    )
    parser.add_argument("--model", required=True, help="local HF dir, .gguf file, or registry name")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port (default 30000, SGLang's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=32, help="KV slots (concurrent requests)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context per request, in tokens (default: the model's, at most 4096)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens fed per step (default 2048 on CPU, 512 on CUDA)",
    )
    parser.add_argument(
        "--idle-prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens in a step where no request decodes (default 8192 on CUDA, else "
        "--prefill-chunk)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the name /get_model_info reports"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the model's own)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode CUDA graphs (default: on for CUDA)",
    )
    parser.add_argument(
        "--prompt-hold-steps",
        type=int,
        default=None,
        help="while every running request decodes, new prompts wait up to this many steps "
        "and prefill together (default 16 with CUDA graphs, else 0)",
    )
    parser.add_argument(
        "--overlap-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue each decode step before reading the previous one's tokens "
        "(default: on with CUDA graphs)",
    )
    parser.add_argument(
        "--recompute-kv-on-update",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after a weight update, in-flight requests recompute their keys and values "
        "under the new weights (default: on)",
    )
    parser.add_argument(
        "--reuse-prefixes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="copy a prompt's cached prefix from another request instead of prefilling it "
        "(default: on)",
    )
    parser.add_argument(
        "--weight-version",
        type=int,
        default=0,
        help="the weight version the loaded model serves as (default 0)",
    )
    # A supervisor's pipe (services/lifeline.py): the server exits when it closes.
    parser.add_argument("--lifeline", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from areal_sdk.models import MaxModelLenError, ModelNotFoundError, WeightMismatchError

    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        return fail(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    chunk_ok = all(c is None or c >= 1 for c in (args.prefill_chunk, args.idle_prefill_chunk))
    len_ok = args.max_model_len is None or args.max_model_len >= 16
    if args.max_batch_size < 1 or not len_ok or not chunk_ok:
        return fail(
            "--max-batch-size, --prefill-chunk and --idle-prefill-chunk must be >= 1, "
            "--max-model-len >= 16"
        )
    if args.prompt_hold_steps is not None and args.prompt_hold_steps < 0:
        return fail(f"--prompt-hold-steps must be >= 0, got {args.prompt_hold_steps}")
    if args.weight_version < 0:
        return fail(f"--weight-version must be >= 0, got {args.weight_version}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return fail("--device cuda was asked for, but torch sees no CUDA device")

    import uvicorn

    from areal_sdk.services.lifeline import exit_with_parent

    if args.lifeline is not None:
        exit_with_parent(args.lifeline, name="engine server")  # never outlive its fleet
    # SIGTERM ends the server cleanly (exit 0). While the model loads there is nothing to
    # close; once serving, uvicorn finishes its shutdown and hands the signal back.
    signal.signal(signal.SIGTERM, _exit_now)

    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig
    from areal_sdk.backends.embedded.server import KEEP_ALIVE_S, create_app
    from areal_sdk.compute_threads import call_in_fresh_thread

    # Plain lines too: a service log (no terminal) shows where a slow start stands.
    console.print(f"loading {args.model} on {args.device}", highlight=False)
    began = time.perf_counter()
    try:
        with console.status(f"loading {args.model} on {args.device}"):
            # On a thread that exits: this one will serve HTTP and must not keep an OpenMP
            # team beside the engine's (areal_sdk/compute_threads.py).
            engine = call_in_fresh_thread(
                EmbeddedEngine.from_pretrained,
                args.model,
                device=args.device,
                dtype=args.dtype,
                model_name=args.served_model_name,
                tokenizer=args.tokenizer,
                version=args.weight_version,
                config=EngineConfig(
                    max_batch_size=args.max_batch_size,
                    max_model_len=args.max_model_len,
                    prefill_chunk=args.prefill_chunk,
                    idle_prefill_chunk=args.idle_prefill_chunk,
                    cuda_graphs=args.cuda_graphs,
                    prompt_hold_steps=args.prompt_hold_steps,
                    overlap_decode=args.overlap_decode,
                    recompute_kv_on_update=args.recompute_kv_on_update,
                    reuse_prefixes=args.reuse_prefixes,
                ),
            )
    except (ModelNotFoundError, MaxModelLenError, WeightMismatchError) as exc:
        return fail(str(exc))
    signal.signal(signal.SIGTERM, _exit_cleanly)
    graphs = engine.runner.graph_count
    console.print(
        f"loaded in {time.perf_counter() - began:.1f} s"
        + (f" ({graphs} decode CUDA graphs captured)" if graphs else ""),
        highlight=False,
    )
    console.print(
        f"serving [bold]{engine.model_name}[/] on http://{args.host}:{args.port}", highlight=False
    )
    try:
        uvicorn.run(
            create_app(engine),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
            # Requests still generating at a SIGTERM get this long, then the server exits.
            timeout_graceful_shutdown=5,
        )
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _exit_now(signum: int, frame: object) -> None:
    os._exit(0)
