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
    # Escaped: a path, a reason or a `pip install "areal-sdk[camel]"` hint holds brackets that
    # rich would read as markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.stderr.flush()
    return code


# Errors a user causes and can act on, as (module, class, prefix): the CLI prints their message
# as one `error:` line. Looked up in sys.modules, so the CLI imports nothing to know them: an
# exception of a module that was never imported cannot have been raised.
USER_ERRORS = (
    ("areal_sdk.config", "ConfigError", ""),
    ("areal_sdk.tasks", "TaskError", ""),
    ("areal_sdk.models", "ModelNotFoundError", ""),
    ("areal_sdk.plugin_host", "PluginError", ""),
    ("areal_sdk.launcher", "LaunchError", ""),
    ("areal_sdk.training_run", "RunError", ""),
    ("areal_sdk.trainer", "TrainingError", ""),
    ("areal_sdk.store", "StoreError", ""),
    ("sqlite3", "Error", "trajectory store: "),
    ("areal_sdk.backends.sglang.pool", "NoServerLeft", ""),
    ("areal_sdk.services.health", "ServiceFailed", ""),
    ("areal_sdk.services.placement", "PlacementError", ""),
    ("areal_sdk.train_process", "TrainProcessError", ""),
)


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message for ``exc`` when a user can fix it, else None (a bug: let the
    traceback through). A group of one such error (from a task group) counts as that error."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    for module_name, class_name, prefix in USER_ERRORS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return prefix + " ".join(str(exc).split())
    return None


def add_config_arguments(parser) -> None:
    parser.add_argument("config", help="path to the run's YAML config")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a config value, e.g. rollout.group_size=8 train.lr=1e-6",
    )
