"""``areal-sdk trajectories export RUN_DIR [--format jsonl|parquet] [-o OUT]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from areal_sdk.cli._common import err_console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("trajectories", help="read a run's stored episodes")
    actions = parser.add_subparsers(dest="trajectories_command", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export",
        help="write a run's episodes as JSON lines or Parquet, with each turn's text",
        description=(
            "Export the episodes stored in RUN_DIR (or a .db file): one per JSON line, or one "
            "per Parquet row. Each turn keeps its token ids and gains prompt_text and "
            "completion_text, decoded with the tokenizer of the model in RUN_DIR/config.yaml."
        ),
    )
    export.add_argument("run_dir", help="a run directory, or its trajectories.db")
    export.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    export.add_argument(
        "-o",
        "--output",
        help="file to write (default: standard output, jsonl only); for parquet, a path "
        "without the .parquet suffix becomes a Hugging Face dataset directory",
    )
    export.add_argument("--status", choices=["ok", "failed", "truncated"], help="only this status")
    export.add_argument("--run-id", help="only episodes of this run id")
    export.add_argument(
        "--tokenizer",
        metavar="MODEL",
        help="decode with this model's tokenizer (a directory, .gguf file or registry name) "
        "instead of the run's",
    )
    export.add_argument("--no-text", action="store_true", help="export ids only, decode nothing")
    export.set_defaults(func=export_trajectories)


def export_trajectories(args: argparse.Namespace) -> int:
    from areal_sdk.store import StoreError, TrajectoryStore
    from areal_sdk.trajectory_export import (
        ExportError,
        check_output,
        load_tokenizer,
        model_of_run,
        with_text,
        write_atomically,
        write_jsonl,
        write_parquet,
    )

    filters = {"status": args.status, "run_id": args.run_id}
    try:
        if args.format == "parquet" and not args.output:
            raise ExportError("--format parquet writes a file: give -o FILE.parquet or -o DIR")
        target = check_output(Path(args.output), args.format) if args.output else None
        with TrajectoryStore.open_existing(args.run_dir) as store:
            records = store.records(**filters)
            if not args.no_text:
                source = args.tokenizer or model_of_run(Path(store.path).parent)
                if source is None:
                    err_console.print(
                        f"note: no {Path(store.path).parent / 'config.yaml'} names the run's "
                        "model, so turns carry ids only; pass --tokenizer MODEL for their text",
                        highlight=False,
                        soft_wrap=True,
                    )
                else:
                    records = with_text(records, load_tokenizer(source))
            if target is None:
                count = write_jsonl(records, sys.stdout)
            elif args.format == "parquet":
                count = write_atomically(target, lambda path: write_parquet(records, path))
            else:

                def to_jsonl(path: Path) -> int:
                    with path.open("w") as out:
                        return write_jsonl(records, out)

                count = write_atomically(target, to_jsonl)
    except (StoreError, ExportError) as exc:
        return fail(str(exc), code=1)
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc.strerror or exc}", code=1)
    if args.output:
        err_console.print(f"wrote {count} episodes to {args.output}", highlight=False)
    return 0
