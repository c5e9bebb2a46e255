"""``areal-sdk export RUN_DIR [--step N] -o OUT [--format hf|gguf] [--dtype D]``."""

from __future__ import annotations

import argparse

from areal_sdk.cli._common import err_console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a run's trained model alone (Hugging Face directory or GGUF)",
        description=(
            "Write the model of a run's checkpoint without the trainer's state: a Hugging "
            "Face directory (from_pretrained, vLLM, SGLang, `areal-sdk serve --model`) or, "
            "with --format gguf, one GGUF file for llama.cpp-based tools (Llama, SmolLM and "
            "Qwen2 models)."
        ),
    )
    parser.add_argument("run_dir", help="a run directory, or one of its checkpoints/step-N")
    parser.add_argument("--step", type=int, help="the checkpoint of this step (default: newest)")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        help="a new directory; with --format gguf a .gguf file (or a directory for model.gguf)",
    )
    parser.add_argument("--format", choices=["hf", "gguf"], default="hf")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.set_defaults(func=export_model)


def export_model(args: argparse.Namespace) -> int:
    from areal_sdk.export import export_run

    try:
        out = export_run(
            args.run_dir, args.output, step=args.step, fmt=args.format, dtype=args.dtype
        )
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    err_console.print(f"wrote {out}")
    return 0
