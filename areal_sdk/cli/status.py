"""``areal-sdk status RUN_DIR``: the services of a run and their state."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from areal_sdk.cli._common import console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="the services of a live run (engine servers, gateway, workers, trainer)",
        description=(
            "Ask the run in RUN_DIR for its services and print each one's phase, pid, address "
            "and restarts; for a run that has ended, print the states it recorded last."
        ),
    )
    parser.add_argument("run_dir", type=Path, help="the run's directory (run.dir)")
    parser.set_defaults(func=status)


def live_services(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """The run's ``services.json`` and, if it still answers, its services now (else None)."""
    import httpx

    from areal_sdk.services.control import read_services_file

    record = read_services_file(run_dir)
    if not record.get("live"):
        return record, None
    try:
        response = httpx.get(
            record["url"] + "/services",
            headers={"Authorization": f"Bearer {record['token']}"},
            timeout=10,
        )
        response.raise_for_status()
    except httpx.HTTPError:
        return record, None  # the run died without rewriting the file
    return record, list(response.json()["services"])


def status(args: argparse.Namespace) -> int:
    from rich.table import Table

    try:
        record, services = live_services(args.run_dir)
    except FileNotFoundError as exc:
        return fail(str(exc))
    if services is None:
        services = record.get("services") or []
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("updated", 0)))
        alive = "did not answer (it died)" if record.get("live") else f"ended {ended}"
        console.print(f"run in {args.run_dir}: {alive}; last recorded states:", highlight=False)
    else:
        console.print(
            f"run in {args.run_dir} (pid {record.get('pid')}, placement "
            f"{record.get('placement')}): live",
            highlight=False,
        )
    table = Table("service", "kind", "phase", "pid", "address", "restarts", "last error")
    for s in services:
        table.add_row(
            s["name"],
            s["kind"],
            s["phase"],
            str(s.get("pid") or "-"),
            s.get("url") or "-",
            str(s.get("restarts", 0)),
            (s.get("last_error") or "")[:80],
        )
    console.print(table)
    return 0
