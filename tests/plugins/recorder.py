"""A real HTTP server on 127.0.0.1 that records each request and answers in the caller's wire
format: OpenAI chat completions (plain and streamed), OpenAI responses, Anthropic messages.

When the request offers tools and carries no tool result yet, the answer calls the first tool
(arguments filled from its JSON schema), so framework tool loops run for real; otherwise it
answers with text that echoes the last user message, so tests can match calls to episodes.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Recorded:
    server: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def bearer(self) -> str | None:
        auth = self.headers.get("authorization", "")
        return auth[7:] if auth.lower().startswith("bearer ") else None

    @property
    def api_key(self) -> str | None:
        """The key the caller authenticated with (OpenAI bearer or Anthropic x-api-key)."""
        return self.headers.get("x-api-key") or self.bearer

    @property
    def metadata(self) -> dict[str, Any]:
        raw = self.headers.get("x-areal-metadata")
        return json.loads(raw) if raw else {}


def _example(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return 2
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: _example(v) for k, v in props.items() if k in schema.get("required", props)}
    return "Tokyo"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict)
        ).strip()
    return ""


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            text = _text_of(message.get("content"))
            if text:
                return text
    return ""


@dataclass
class Recorder:
    name: str
    requests: list[Recorded] = field(default_factory=list)
    url: str = ""
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    def clear(self) -> None:
        self.requests.clear()

    # -- the app ---------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI()

        async def record(request: Request) -> dict[str, Any]:
            raw = await request.body()
            body = json.loads(raw) if raw else {}
            self.requests.append(
                Recorded(
                    self.name,
                    request.url.path,
                    {k.lower(): v for k, v in request.headers.items()},
                    body,
                )
            )
            return body

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await record(request)
            messages = body.get("messages", [])
            tools = body.get("tools") or []
            done = any(m.get("role") == "tool" for m in messages)
            message: dict[str, Any] = {"role": "assistant", "content": None}
            finish = "stop"
            if tools and not done:
                fn = tools[0]["function"]
                args = json.dumps(_example(fn.get("parameters") or {}))
                message["tool_calls"] = [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": args},
                    }
                ]
                finish = "tool_calls"
            else:
                message["content"] = f"[{self.name}] {_last_user_text(messages)}"
            model = body.get("model", "policy")
            if body.get("stream"):
                return StreamingResponse(
                    self._chat_stream(model, message, finish), media_type="text/event-stream"
                )
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }

        @app.post("/v1/responses")
        async def responses(request: Request) -> Any:
            body = await record(request)
            items = body.get("input")
            items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
            tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
            done = any(i.get("type") == "function_call_output" for i in items)
            if tools and not done:
                args = json.dumps(_example(tools[0].get("parameters") or {}))
                output = [
                    {
                        "type": "function_call",
                        "id": "fc_1",
                        "call_id": "call_1",
                        "name": tools[0]["name"],
                        "arguments": args,
                        "status": "completed",
                    }
                ]
            else:
                output = [
                    {
                        "type": "message",
                        "id": "msg_1",
                        "status": "completed",
                        "role": "assistant",
                        "content": [
                            {
                                "type": "output_text",
                                "text": f"[{self.name}] {_last_user_text(items)}",
                                "annotations": [],
                            }
                        ],
                    }
                ]
            return {
                "id": "resp_1",
                "object": "response",
                "created_at": int(time.time()),
                "status": "completed",
                "model": body.get("model", "policy"),
                "output": output,
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": body.get("tools") or [],
                "usage": {
                    "input_tokens": 3,
                    "output_tokens": 2,
                    "total_tokens": 5,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0},
                },
            }

        @app.post("/v1/messages")
        async def messages(request: Request) -> Any:
            body = await record(request)
            msgs = body.get("messages", [])
            tools = body.get("tools") or []
            done = any(
                isinstance(m.get("content"), list)
                and any(
                    isinstance(b, dict) and b.get("type") == "tool_result" for b in m["content"]
                )
                for m in msgs
            )
            if tools and not done:
                content = [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": tools[0]["name"],
                        "input": _example(tools[0].get("input_schema") or {}),
                    }
                ]
                stop = "tool_use"
            else:
                content = [{"type": "text", "text": f"[{self.name}] {_last_user_text(msgs)}"}]
                stop = "end_turn"
            return {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", "policy"),
                "content": content,
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": {"input_tokens": 3, "output_tokens": 2},
            }

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def anything(request: Request, path: str) -> Any:
            await record(request)
            return JSONResponse(
                {"error": {"message": f"no route /{path}", "type": "not_found"}}, 404
            )

        return app

    @staticmethod
    def _chat_stream(model: str, message: dict[str, Any], finish: str):
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model}
        delta = {k: v for k, v in message.items() if v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(delta["tool_calls"])]
        for chunk in (
            {"index": 0, "delta": delta, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": finish},
        ):
            yield f"data: {json.dumps({**base, 'choices': [chunk]})}\n\n"
        yield "data: [DONE]\n\n"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Recorder:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError(f"recorder {self.name} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
