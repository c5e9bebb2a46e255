"""The gateway's listening socket says TCP and turns Nagle off. Without that, asyncio left
Nagle on for every connection, and each response's last small write waited for the client's
delayed ACK: about 40 ms added to every call through the gateway's in-process server and
``areal-sdk serve`` (``benchmarks/README.md``, Gateway). The socket listens from the start,
so an early client waits instead of being refused. Also ``ServerThread``'s start and stop."""

from __future__ import annotations

import socket

import httpx
import pytest

from areal_sdk.server_thread import ServerStartError, ServerThread, bind_tcp


async def _empty_app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    """An ASGI app that answers nothing; the lifespan is off where it is used."""


def test_the_listening_socket_is_tcp_with_nodelay() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_a_client_that_learns_the_address_before_the_server_starts_is_not_refused() -> None:
    # `areal-sdk serve` prints its address after binding and before uvicorn starts; a client
    # reading that line connects at once.
    sock = bind_tcp("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass
    finally:
        sock.close()


def test_server_thread_serves_the_gateway_on_that_socket(engine) -> None:  # type: ignore[no-untyped-def]
    from areal_sdk.gateway import create_app

    app = create_app(engine, admin_token="admin")
    with ServerThread(app, name="gateway") as server:
        assert server._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert server.url == f"http://127.0.0.1:{server.port}"
        reply = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer admin"})
        assert reply.status_code == 200
        # Its lifespan ran: the gateway knows the event loop that serves it.
        assert app.state.gateway.loop is not None


def test_a_port_in_use_is_a_server_start_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"the busy cannot bind http://127.0.0.1:{port}"):
            ServerThread(_empty_app, port=port, name="busy", lifespan="off")


def test_stop_twice_is_fine() -> None:
    server = ServerThread(_empty_app, name="twice", lifespan="off")
    assert server.port > 0
    assert server.start(timeout_s=10) == server.url
    server.stop()
    server.stop()
    assert server._sock.fileno() == -1  # the socket is closed
    # Never started: stop is fine too, as often as asked.
    idle = ServerThread(_empty_app, lifespan="off")
    idle.stop()
    idle.stop()


def test_ipv6_urls_bracket_the_host() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server = ServerThread(_empty_app, host="::1", lifespan="off")
    except ServerStartError:
        pytest.skip("::1 cannot be bound here")
    try:
        assert server.url == f"http://[::1]:{server.port}"
    finally:
        server.stop()
