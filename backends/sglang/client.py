"""One SGLang server's native HTTP routes, with timeouts and retries with backoff.

Every call has a deadline. Calls that are safe to repeat (control routes, ``/health``) are
retried on connection errors and 5xx answers with exponential backoff; ``/generate`` is
retried only when the request never reached the server (connection refused). A server that
stops answering raises ``ServerUnavailable`` naming its URL, so the caller can take it out
of rotation and send the request elsewhere.

>>> client = ServerClient("http://127.0.0.1:30000", timeout_s=600, retries=3)
>>> await client.post("/pause_generation", {"mode": "abort"})
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import httpx

# Connection errors that mean "this server is gone (or never was)", not "it is slow".
_GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)


class SGLangError(RuntimeError):
    """An SGLang server answered, but refused or failed the call; the message names it."""

    def __init__(self, url: str, route: str, status: int, message: str) -> None:
        super().__init__(f"SGLang server {url}{route} answered {status}: {message}")
        self.url = url
        self.route = route
        self.status = status


class SGLangInputError(SGLangError, ValueError):
    """A 4xx answer: the request itself is wrong (a bad token id, a prompt too long)."""


class ServerUnavailable(ConnectionError):
    """A server that cannot be reached (refused, reset, or no answer in time)."""

    def __init__(self, url: str, route: str, cause: BaseException) -> None:
        super().__init__(
            f"SGLang server {url} is unavailable ({route}: {type(cause).__name__}: {cause})"
        )
        self.url = url


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(data.get("message") or err or data)[:500]
    return str(data)[:500]


class ServerClient:
    """HTTP calls to one SGLang server (or the embedded engine serving SGLang's routes).

    One ``httpx.AsyncClient`` per event loop: the gateway, the trainer and tests may call the
    same backend from different threads' loops, and a connection pool belongs to one loop.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        # Keyed by the loop itself, weakly: a loop's id can be reused by a later loop once
        # the first is gone, and a client of a dead loop would hang the new one's calls.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]
        self._clients = weakref.WeakKeyDictionary()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(
                base_url=self.url,
                timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                # Idle connections are dropped before the server's keep-alive timeout (5 s in
                # SGLang's uvicorn): reusing one the server is closing at that instant fails a
                # request that was never served.
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
                ),
            )
            self._clients[loop] = client
        return client

    async def request(
        self,
        method: str,
        route: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        idempotent: bool = True,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One call; raises ``SGLangError`` (4xx, or 5xx after retries) or
        ``ServerUnavailable``. Non-idempotent calls are retried only if never sent."""
        timeout = httpx.USE_CLIENT_DEFAULT
        if timeout_s is not None:
            timeout = httpx.Timeout(timeout_s, connect=self.connect_timeout_s)
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await self._client().request(
                    method, route, json=body, timeout=timeout, headers=headers
                )
            except _REFUSED as exc:
                if last:
                    raise ServerUnavailable(self.url, route, exc) from exc
            except (*_GONE, httpx.TimeoutException) as exc:
                if last or not idempotent:
                    raise ServerUnavailable(self.url, route, exc) from exc
            else:
                if response.status_code < 500 or last or not idempotent:
                    if 400 <= response.status_code < 500:
                        raise SGLangInputError(
                            self.url, route, response.status_code, _message(response)
                        )
                    if response.status_code >= 500:
                        raise SGLangError(self.url, route, response.status_code, _message(response))
                    return response
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    async def get(self, route: str, **kw: Any) -> httpx.Response:
        return await self.request("GET", route, **kw)

    async def post(self, route: str, body: Any = None, **kw: Any) -> httpx.Response:
        return await self.request("POST", route, {} if body is None else body, **kw)

    async def post_json(self, route: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        """POST and return the JSON answer; SGLang's ``{"success": false}`` is an error."""
        response = await self.post(route, body, **kw)
        data = response.json() if response.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise SGLangError(self.url, route, response.status_code, str(data.get("message")))
        return data

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        """One ``GET /health`` without retries: True on 200."""
        try:
            response = await self._client().get("/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        clients, self._clients = self._clients, weakref.WeakKeyDictionary()
        loop = asyncio.get_running_loop()
        for key, client in list(clients.items()):
            if key == loop:
                await client.aclose()
            # Clients of other loops die with their loops; closing them here would hang.
