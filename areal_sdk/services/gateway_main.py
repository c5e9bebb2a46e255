"""The gateway's own process: ``python -m areal_sdk.services.gateway_main``, started by
``GatewayProcess`` (not by hand).

It serves the gateway app on the listening socket the parent bound and passed down
(``--fd``), over an ``SGLangBackend`` on the engine servers' URLs, and writes finished
episodes to the run's store. The config arrives as the resolved YAML in a file, the admin
token in the environment (never on the command line, where ``ps`` shows it). It exits when
the parent does (``--lifeline``), and on SIGTERM after finishing the calls in flight.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

import yaml

from areal_sdk.services.child_logging import configure_service_logging
from areal_sdk.services.lifeline import exit_with_parent

log = logging.getLogger("areal_sdk.services.gateway")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m areal_sdk.services.gateway_main")
    parser.add_argument("--config", required=True, help="the run's resolved config (YAML)")
    parser.add_argument("--fd", type=int, required=True, help="the bound listening socket")
    parser.add_argument("--store", required=True, help="the run's trajectories.db")
    parser.add_argument("--engines", nargs="+", required=True, help="engine servers' URLs")
    parser.add_argument("--version", type=int, default=0, help="the weight version they serve")
    parser.add_argument("--lifeline", type=int, default=None, help="exit when this fd closes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.lifeline is not None:
        exit_with_parent(args.lifeline, name="gateway")
    configure_service_logging()
    # Heavy imports after the lifeline is up: a parent that dies while they load is seen.
    import uvicorn

    from areal_sdk.backends.sglang import SGLangBackend
    from areal_sdk.config import Config
    from areal_sdk.gateway import create_app
    from areal_sdk.launcher import ADMIN_TOKEN_ENV, RunSink
    from areal_sdk.store import TrajectoryStore

    token = os.environ.pop(ADMIN_TOKEN_ENV, "")
    if not token:
        print(f"error: the admin token ({ADMIN_TOKEN_ENV}) is not set", file=sys.stderr)
        return 2
    cfg = Config.model_validate(yaml.safe_load(Path(args.config).read_text()))
    cfg.inference.urls = list(args.engines)
    try:
        backend = SGLangBackend.from_config(cfg)
    except Exception as exc:  # no engine server answers: say so in the log, in one line
        print(f"error: the gateway cannot reach its engine servers: {exc}", file=sys.stderr)
        return 1
    if backend.version != args.version:
        log.warning(
            "the engine servers serve weight version %s, the run is at %s",
            backend.version,
            args.version,
        )
    store = TrajectoryStore(args.store)
    app = create_app(
        backend,
        admin_token=token,
        episode_sink=RunSink(store),
        model_name=cfg.model.served_name,
        tool_parser=cfg.inference.tool_parser,
        default_max_tokens=cfg.inference.max_new_tokens,
        session_idle_timeout_s=cfg.inference.session_idle_timeout_s,
    )
    # fileno= reads the family (IPv4 or v6) and protocol from the socket itself.
    sock = socket.socket(fileno=args.fd)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    )
    log.info("serving on %s over %s", sock.getsockname(), ", ".join(args.engines))
    server.run(sockets=[sock])
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
