"""Helpers shared by the CLI commands."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


PROGRESS_LOGGER = "areal_sdk.progress"


class _ConsoleHandler(logging.Handler):
    """Log records as plain lines on standard error (above a running progress bar)."""

    def emit(self, record: logging.LogRecord) -> None:
        err_console.print(
            f"[dim]·[/] {escape(self.format(record))}", highlight=False, soft_wrap=True
        )


def show_progress_messages() -> None:
    """Print what long silent work is doing (the first model fetch and conversion, the
    kernels' build) instead of leaving the terminal quiet for tens of seconds."""
    logger = logging.getLogger(PROGRESS_LOGGER)
    if not logger.handlers:
        logger.addHandler(_ConsoleHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False


def fail(message: str, code: int = 2) -> int:
    """Print an error the way every command does, and return the exit code."""
    # Escaped: a path or a reason may hold brackets that rich would read as markup.
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
