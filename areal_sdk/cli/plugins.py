"""``areal-sdk plugins``: every plugin, where it came from, and whether it is usable."""

from __future__ import annotations

import argparse
import json

from areal_sdk.cli._common import console


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list plugins: name, kind, source, usable or why not",
        description="List every plugin of the areal_sdk entry-point group and its status.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from areal_sdk.plugin_host import get_host

    host = get_host()
    records = host.plugins()
    if args.json:
        rows = [
            {
                "name": r.name,
                "kind": ", ".join(r.kinds) if r.loaded else "unknown",
                "source": r.source,
                "usable": r.status.usable,
                "reason": r.status.reason,
                "extra": r.status.extra,
            }
            for r in records
        ]
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="areal-sdk plugins")
    table.add_column("name", style="bold")
    table.add_column("kind")
    table.add_column("source")
    table.add_column("status")
    for r in records:
        kinds = ", ".join(r.kinds) if r.loaded else "-"
        status = "[green]usable[/]" if r.status.usable else f"[red]unusable[/]: {r.status.reason}"
        table.add_row(r.name, kinds, r.source, status)
    console.print(table)
    return 0
