"""Which SGLang server serves a request: least loaded, sticky per episode, dead ones out.

A multi-turn episode should keep hitting the server that holds its prefix in cache, so a
request with an affinity key goes where that key went before; a new key (or one whose
server died) goes to the live server with the fewest requests in flight. The key is the
part of the request id before the first ``":"`` (``"<episode>:<turn>"``), or the whole id.
Requests without an id are spread by load alone.

Membership can change while requests run (``add``, ``remove``): a removed server gets no
new request, the requests it is running finish, and its keys move to a live server.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from areal_sdk.backends.sglang.client import ServerClient

# Affinity entries kept; old episodes fall out first.
MAX_KEYS = 100_000


def affinity_key(request_id: str | None) -> str | None:
    if not request_id:
        return None
    return request_id.split(":", 1)[0]


class NoServerLeft(ConnectionError):
    """Every server is out of rotation; the message names them and why."""


@dataclass
class Server:
    client: ServerClient
    alive: bool = True
    in_flight: int = 0
    error: str = ""
    tp_size: int = 1
    info: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.client.url


class ServerPool:
    def __init__(self, servers: list[Server]) -> None:
        if not servers:
            raise ValueError("the sglang backend needs at least one server URL")
        self.servers = servers
        self._sticky: OrderedDict[str, Server] = OrderedDict()

    @property
    def live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def pick(self, key: str | None, *, exclude: set[str] = frozenset()) -> Server:  # type: ignore[assignment]
        if key is not None:
            server = self._sticky.get(key)
            if server is not None and server.alive and server.url not in exclude:
                self._sticky.move_to_end(key)
                return server
        candidates = [s for s in self.live if s.url not in exclude]
        if not candidates:
            raise NoServerLeft(self.describe_dead())
        server = min(candidates, key=lambda s: s.in_flight)
        if key is not None:
            self._sticky[key] = server
            while len(self._sticky) > MAX_KEYS:
                self._sticky.popitem(last=False)
        return server

    def find(self, url: str) -> Server | None:
        url = url.rstrip("/")
        return next((s for s in self.servers if s.url == url), None)

    def add(self, server: Server) -> None:
        """Put ``server`` in rotation (a member with its URL already is marked alive)."""
        known = self.find(server.url)
        if known is None:
            self.servers.append(server)
        else:
            self.mark_alive(known)

    def remove(self, url: str) -> Server | None:
        """Take the server at ``url`` out of the pool. It is marked not alive, so requests
        running on it finish but no request (and no sticky key) picks it again."""
        server = self.find(url)
        if server is not None:
            self.servers.remove(server)
            self.mark_dead(server, "removed")
        return server

    def mark_dead(self, server: Server, error: str) -> None:
        server.alive = False
        server.error = error

    def mark_alive(self, server: Server) -> None:
        server.alive = True
        server.error = ""

    def describe_dead(self) -> str:
        dead = "; ".join(f"{s.url}: {s.error or 'out of rotation'}" for s in self.servers)
        return f"no SGLang server left to serve the request ({dead})"
