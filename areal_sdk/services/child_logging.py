"""Logging of a service's process: its own events at INFO into its log file, and the HTTP
clients' per-request lines left out (a health probe a second would bury everything else)."""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2")


def configure_service_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
