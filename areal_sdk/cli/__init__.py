"""The ``areal-sdk`` command line.

Each command is a module of this package with ``add_parser(subparsers)``; modules import
their heavy dependencies inside the command, so ``areal-sdk --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# In the order `areal-sdk --help` lists them.
COMMAND_MODULES = (
    "train",
    "rollout",
    "serve",
    "engine",
    "models",
    "plugins",
    "config",
    "trajectories",
    "export",
    "status",
    "engines",
)


def build_parser() -> argparse.ArgumentParser:
    from areal_sdk import __version__

    parser = argparse.ArgumentParser(
        prog="areal-sdk",
        description="Train an existing LLM agent with asynchronous reinforcement learning.",
    )
    parser.add_argument("--version", action="version", version=f"areal-sdk {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"areal_sdk.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"areal_sdk.cli.{name}":
                continue  # a command this installation does not ship
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may come after flags too (`train CONFIG --resume run.steps=32`).
    if extra and isinstance(getattr(args, "overrides", None), list):
        if any(token.startswith("-") or "=" not in token for token in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides.extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        sys.exit(2 if args.command is None else 0)
    from areal_sdk.cli._common import show_progress_messages

    show_progress_messages()
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        from areal_sdk.cli._common import fail, user_error_message

        message = user_error_message(exc)
        if message is None:
            raise
        code = fail(message, code=1)
    sys.exit(code or 0)
