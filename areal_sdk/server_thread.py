"""Serve an ASGI app with uvicorn on a background thread (the launcher, tests, benchmarks).

>>> with ServerThread(app, name="gateway") as server:     # doctest: +SKIP
...     httpx.get(server.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Literal

import uvicorn


class ServerStartError(RuntimeError):
    """A ``ServerThread`` could not bind its port, or its server did not come up."""


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) and listening, for uvicorn's
    ``sockets=``. Listening at once means a client that learns the address before uvicorn
    has started waits in the backlog instead of being refused.

    The protocol is named (``IPPROTO_TCP``, not 0) and ``TCP_NODELAY`` set: asyncio turns
    Nagle off only on connections whose socket says TCP, and with it on, each response's last
    small write waited for the client's delayed ACK, about 40 ms per call."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` (port 0 picks a free one) in a daemon thread.

    The socket is bound here, in the constructor, through ``bind_tcp``: ``port`` is known at
    once, no other process can take the port between choosing and binding it, and a port in
    use fails now, as a ``ServerStartError``. Given ``sock`` (from ``bind_tcp``), it serves
    that socket instead, ``host`` naming its address. ``start`` returns ``url`` once the
    server accepts connections; ``stop`` may be called any number of times.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        name: str = "server",
        lifespan: Literal["auto", "on", "off"] = "on",
        keep_alive_s: float = 30.0,
        log_level: str = "warning",
    ) -> None:
        self.name = name
        self.host = host
        try:
            self._sock = sock if sock is not None else bind_tcp(host, port)
        except OSError as exc:
            raise ServerStartError(
                f"the {name} cannot bind {self._url(host, port)}: {exc}"
            ) from exc
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level=log_level,
            lifespan=lifespan,
            # uvicorn annotates an int but only hands it to loop.call_later: a float works.
            timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
            access_log=False,  # skip the per-request log call, not just filter it by level
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @staticmethod
    def _url(host: str, port: int) -> str:
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def url(self) -> str:
        """``http://host:port``, the host in brackets when it is IPv6."""
        return self._url(self.host, self.port)

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving; returns ``url`` once the server accepts connections."""
        self._thread = threading.Thread(
            # uvicorn's own runner: its event loop (uvloop where installed), not asyncio's.
            target=lambda: self._server.run(sockets=[self._sock]),
            name=f"areal-{self.name}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                # uvicorn logs why (the lifespan failed, listen() refused) and exits.
                self.stop()
                raise ServerStartError(f"the {self.name} exited while starting on {self.url}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"the {self.name} did not start on {self.url} within {timeout_s:g} s"
                )
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to finish, wait for its thread, close the socket; idempotent."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()  # closing a closed socket is a no-op

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
