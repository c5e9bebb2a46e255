"""``areal-sdk engines add|remove RUN_DIR``: grow or shrink a live run's inference."""

from __future__ import annotations

import argparse
from pathlib import Path

from areal_sdk.cli._common import console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "engines",
        help="add an engine server to a live run, or remove one",
        description=(
            "A run with run.placement=processes takes engine servers while it trains: "
            "`add` launches one more (or attaches --url, a server already running the "
            "run's model), brings it to the current weights, then routes requests to it; "
            "`remove URL` stops routing to it, lets its requests finish, and stops it."
        ),
    )
    parser.add_argument("action", choices=["add", "remove"])
    parser.add_argument("run_dir", type=Path, help="the live run's directory (run.dir)")
    parser.add_argument("url", nargs="?", help="remove: the server's URL; add: attach this one")
    parser.set_defaults(func=engines)


def engines(args: argparse.Namespace) -> int:
    import httpx

    from areal_sdk.services.control import read_services_file

    if args.action == "remove" and not args.url:
        return fail("engines remove needs the server's URL (see `areal-sdk status RUN_DIR`)")
    try:
        record = read_services_file(args.run_dir)
    except FileNotFoundError as exc:
        return fail(str(exc))
    if not record.get("live"):
        return fail(f"the run in {args.run_dir} has ended")
    headers = {"Authorization": f"Bearer {record['token']}"}
    body = {"url": args.url} if args.url else {}
    method = "POST" if args.action == "add" else "DELETE"
    try:
        with console.status(f"{args.action} engine server"):
            response = httpx.request(
                method, record["url"] + "/engines", json=body, headers=headers, timeout=900
            )
    except httpx.HTTPError as exc:
        return fail(f"the run in {args.run_dir} did not answer ({exc})")
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        return fail(message)
    answer = response.json()
    done = f"added {answer['url']}" if args.action == "add" else f"removed {answer['removed']}"
    console.print(done, highlight=False)
    return 0
