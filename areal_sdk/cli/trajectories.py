"""``areal-sdk trajectories export RUN_DIR --format jsonl [-o FILE]``."""

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
        help="write a run's episodes as JSON lines",
        description="Export the episodes stored in RUN_DIR (or a .db file), one JSON per line.",
    )
    export.add_argument("run_dir", help="a run directory, or its trajectories.db")
    export.add_argument("--format", choices=["jsonl"], default="jsonl")
    export.add_argument("-o", "--output", help="file to write (default: standard output)")
    export.add_argument("--status", choices=["ok", "failed", "truncated"], help="only this status")
    export.add_argument("--run-id", help="only episodes of this run id")
    export.set_defaults(func=export_trajectories)


def export_trajectories(args: argparse.Namespace) -> int:
    from areal_sdk.store import STORE_FILENAME, TrajectoryStore

    source = Path(args.run_dir)
    db = source / STORE_FILENAME if source.is_dir() else source
    if not db.is_file():
        return fail(f"no trajectory store at {db} (a run directory holds {STORE_FILENAME})")
    filters = {"status": args.status, "run_id": args.run_id}
    with TrajectoryStore(db) as store:
        if args.output:
            with open(args.output, "w") as out:
                n = store.export_jsonl(out, **filters)
            err_console.print(f"wrote {n} episodes to {args.output}")
        else:
            n = store.export_jsonl(sys.stdout, **filters)
    return 0
