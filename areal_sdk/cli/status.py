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
    try:
        record, services = live_services(args.run_dir)
    except FileNotFoundError as exc:
        return fail(str(exc))
    if services is None:
        services = record.get("services") or []
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("updated", 0)))
        alive = "did not answer (it died)" if record.get("live") else f"ended {ended}"
        console.print(
            f"run in {args.run_dir}: {alive}; last recorded states:",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"run in {args.run_dir} (pid {record.get('pid')}, placement "
            f"{record.get('placement')}): live",
            highlight=False,
            soft_wrap=True,
        )
    # Plain columns, never cut: a script may read the addresses.
    rows = [("service", "kind", "phase", "pid", "address", "restarts", "last error")]
    for svc in services:
        rows.append(
            (
                svc["name"],
                svc["kind"],
                svc["phase"],
                str(svc.get("pid") or "-"),
                svc.get("url") or "-",
                str(svc.get("restarts", 0)),
                " ".join((svc.get("last_error") or "").split())[:120],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0
