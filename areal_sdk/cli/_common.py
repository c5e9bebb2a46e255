"""Helpers shared by the CLI commands."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> int:
    """Print an error the way every command does, and return the exit code."""
    # Escaped: a message's `pip install "areal-sdk[camel]"` is text, not rich markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.stderr.flush()
    return code


def add_config_arguments(parser) -> None:
    parser.add_argument("config", help="path to the run's YAML config")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a config value, e.g. rollout.group_size=8 train.lr=1e-6",
    )
