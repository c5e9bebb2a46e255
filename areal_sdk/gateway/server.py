"""Run the gateway app on loopback in a background thread (tests, benchmarks, in-process use).

>>> with GatewayServer(app) as server:         # doctest: +SKIP
...     OpenAI(base_url=server.base_url + "/v1", api_key=key)
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one), for uvicorn's ``sockets=``.

    The protocol is named (``IPPROTO_TCP``, not 0) and ``TCP_NODELAY`` set: asyncio turns
    Nagle off only on connections whose socket says TCP, and with it on, each response's last
    small write waited for the client's delayed ACK, about 40 ms per call."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class GatewayServer:
    """uvicorn serving ``app`` on ``host:port`` (port 0 picks a free one) in a thread."""

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.app = app
        self.host = host
        self._sock = bind_tcp(host, port)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; returns the base URL once the server accepts connections."""
        self._thread = threading.Thread(
            # uvicorn's own runner: its event loop (uvloop where installed), not asyncio's.
            target=lambda: self._server.run(sockets=[self._sock]),
            name="areal-gateway",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.base_url}")
            time.sleep(0.01)
        return self.base_url

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> GatewayServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
