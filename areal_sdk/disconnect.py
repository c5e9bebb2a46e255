"""ASGI middleware: stop serving a request whose client has gone.

Neither uvicorn nor Starlette cancels a plain (non-streaming) endpoint when its client
disconnects: the handler runs to the end and its answer is thrown away. For a generation
that means the engine keeps sampling a reply nobody will read (an agent that timed out, an
episode that was cancelled). This middleware runs the app in a task of its own, watches for
``http.disconnect`` once the request body is in, and cancels that task if the client leaves
before the response is complete; the engines abort a cancelled ``generate``.

>>> app.add_middleware(CancelOnDisconnect)
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CancelOnDisconnect:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        # What ended the request stream, for the app's own later receive() calls: once the
        # body is in, only the watcher reads the server's receive().
        ended: asyncio.Future[Message] = loop.create_future()
        responded = False
        watcher: asyncio.Task[None] | None = None
        serving: asyncio.Task[None]

        async def watch() -> None:
            message = await receive()
            if not ended.done():
                ended.set_result(message)
            if message["type"] == "http.disconnect" and not responded:
                serving.cancel()

        async def app_receive() -> Message:
            nonlocal watcher
            if ended.done() or watcher is not None:
                return await asyncio.shield(ended)
            message = await receive()
            if message["type"] == "http.disconnect":
                ended.set_result(message)
            elif not message.get("more_body"):
                watcher = loop.create_task(watch())
            return message

        async def app_send(message: Message) -> None:
            nonlocal responded
            if message["type"] == "http.response.body" and not message.get("more_body"):
                responded = True
            await send(message)

        serving = loop.create_task(self.app(scope, app_receive, app_send))
        try:
            await serving
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the server itself is stopping this request
            # The client left: there is nobody to answer.
        finally:
            if not serving.done():
                serving.cancel()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
