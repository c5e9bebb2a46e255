"""``areal-sdk plugins``: every plugin, where it came from, and whether it is usable."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from areal_sdk.cli._common import console

if TYPE_CHECKING:
    from areal_sdk.plugin_host import PluginRecord


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list plugins: what each registers, its source, usable or why not",
        description="List every plugin of the areal_sdk entry-point group and its status.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _provides(record: PluginRecord) -> str:
    """``reward: exact_match, contains; metric sink: jsonl``; ``-`` for a plugin never loaded."""
    if not record.loaded:
        return "-"
    if not record.provides:
        return "hooks"
    return "; ".join(
        f"{kind.replace('_', ' ')}: {', '.join(names)}" for kind, names in record.provides.items()
    )


def run(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from areal_sdk.plugin_host import get_host

    host = get_host()
    records = host.plugins()
    if args.json:
        rows = [
            {
                "name": r.name,
                "kind": ", ".join(r.kinds) if r.loaded else "unknown",
                "provides": {kind: list(names) for kind, names in r.provides.items()},
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
    table.add_column("provides")
    table.add_column("source")
    table.add_column("status")
    for r in records:
        # Text, not markup: a reason's `pip install "areal-sdk[camel]"` must print as written.
        status = (
            Text("usable", style="green")
            if r.status.usable
            else Text.assemble(("unusable", "red"), f": {r.status.reason}")
        )
        table.add_row(Text(r.name), Text(_provides(r)), Text(r.source), status)
    console.print(table)
    return 0
