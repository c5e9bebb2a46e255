"""The gateway's listening socket says TCP and turns Nagle off. Without that, asyncio left
Nagle on for every connection, and each response's last small write waited for the client's
delayed ACK: about 40 ms added to every call through ``GatewayServer`` and ``areal-sdk serve``
(``benchmarks/README.md``, Gateway)."""

from __future__ import annotations

import socket

import httpx

from areal_sdk.gateway.server import GatewayServer, bind_tcp


def test_the_listening_socket_is_tcp_with_nodelay() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_gateway_server_serves_on_that_socket(engine) -> None:  # type: ignore[no-untyped-def]
    from areal_sdk.gateway import create_app

    app = create_app(engine, admin_token="admin")
    with GatewayServer(app) as server:
        assert server._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        reply = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer admin"})
        assert reply.status_code == 200
        # Its lifespan ran: the gateway knows the event loop that serves it.
        assert app.state.gateway.loop is not None
