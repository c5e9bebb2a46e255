"""``POST /v1/messages`` in Anthropic's Messages wire format, streaming (named SSE) or not.

Anthropic's shape is translated into the gateway's conversation: the top-level ``system``
becomes the first message, ``tool_use`` blocks become tool calls (``input`` is an object) and
``tool_result`` blocks in a user turn become tool messages, in order. ``stop_reason`` maps from
the completion: a parsed tool call is ``tool_use``, the token budget ``max_tokens``, a stop
sequence ``stop_sequence``, anything else ``end_turn``. Streaming is live (``live.py``):
thinking and text deltas go out as they are sampled, ``tool_use`` blocks at the end.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from areal_sdk.gateway.conversation import Message, Tool, ToolCall
from areal_sdk.gateway.errors import GatewayError, error_body, unsupported
from areal_sdk.gateway.generation import Sampled
from areal_sdk.gateway.live import ChatStream
from areal_sdk.gateway.openai_chat import turn_headers
from areal_sdk.gateway.state import (
    authenticate,
    call_metadata,
    gateway_of,
    in_call,
    json_body,
    parse,
    read_json,
    sse,
)

router = APIRouter()


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Accepted and ignored.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: dict[str, Any] | None = None  # its ``format`` is refused
    # Refused when set.
    mcp_servers: list[dict[str, Any]] | None = None


def _text_blocks(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(
            400, f"{where}: expected a string or a list of content blocks", param=where
        )
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise unsupported(
                f"{where}.{i}.type", f"Only text blocks are supported here, got {kind!r}."
            )
        out.append(str(block.get("text", "")))
    return "".join(out)


def messages_from_anthropic(system: Any, raw: list[dict[str, Any]]) -> list[Message]:
    messages: list[Message] = []
    if system:
        messages.append(Message("system", _text_blocks(system, "system")))
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise GatewayError(
                400, f"{where}.role: Input should be 'user' or 'assistant'", param=f"{where}.role"
            )
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise GatewayError(
                400, f"{where}.content: expected a string or a list of blocks", param=where
            )
        if role == "assistant":
            text, calls = [], []
            for j, b in enumerate(blocks):
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "text":
                    text.append(str(b.get("text", "")))
                elif kind == "tool_use":
                    if not isinstance(b.get("input"), dict):
                        raise GatewayError(
                            400,
                            f"{where}.content.{j}.input: must be an object",
                            param=f"{where}.content.{j}.input",
                        )
                    calls.append(
                        ToolCall(
                            id=str(b.get("id", "")),
                            name=str(b.get("name", "")),
                            arguments=json.dumps(b["input"], ensure_ascii=False),
                        )
                    )
                elif kind in ("thinking", "redacted_thinking"):
                    continue  # the sampled ids carry the reasoning; the text is not re-rendered
                else:
                    raise unsupported(f"{where}.content.{j}.type", f"Got {kind!r}.")
            messages.append(Message("assistant", "".join(text), tool_calls=calls))
            continue
        pending: list[str] = []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                pending.append(str(b.get("text", "")))
            elif kind == "tool_result":
                if pending:
                    messages.append(Message("user", "".join(pending)))
                    pending = []
                result = _text_blocks(b.get("content"), f"{where}.content.{j}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                messages.append(Message("tool", result, tool_call_id=str(b.get("tool_use_id", ""))))
            else:
                raise unsupported(f"{where}.content.{j}.type", f"Got {kind!r}.")
        if pending or not blocks:
            messages.append(Message("user", "".join(pending)))
    return messages


def stop_reason(c: Sampled) -> str:
    if c.tool_calls:
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    if c.matched_stop is not None:
        return "stop_sequence"
    return "end_turn"


def content_blocks(c: Sampled) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.reasoning:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    if c.content or not c.tool_calls:
        blocks.append({"type": "text", "text": c.content})
    for t in c.tool_calls:
        blocks.append({"type": "tool_use", "id": t.id, "name": t.name, "input": t.arguments_obj()})
    return blocks


@router.post("/v1/messages", response_model=None, openapi_extra=json_body(MessagesRequest))
async def messages(request: Request) -> Response:
    gw = gateway_of(request)
    caller = authenticate(request, "anthropic")
    body = await read_json(request)
    req = parse(MessagesRequest, body)
    if req.mcp_servers:
        raise unsupported("mcp_servers")
    if (req.output_config or {}).get("format"):
        raise unsupported("output_config.format", "Structured output is not supported.")
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise unsupported(
                f"tools.{i}.type", f"Only client tools are supported, got {t.type!r}."
            )
    msgs = messages_from_anthropic(req.system, req.messages)
    tools = [Tool(t.name, t.description or "", t.input_schema) for t in req.tools or []]
    choice = req.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise GatewayError(
            400, f"tool_choice.type: unknown value {kind!r}", param="tool_choice.type"
        )
    if kind == "tool" and choice.get("name") not in {t.name for t in tools}:
        raise GatewayError(
            400,
            f"tool_choice names tool {choice.get('name')!r}, which is not in tools",
            param="tool_choice.name",
        )
    use_tools = bool(tools) and kind != "none"
    kwargs: dict[str, Any] = {}
    if req.thinking and "enable_thinking" in gw.generator.builder.template:
        kwargs["enable_thinking"] = req.thinking.get("type") in ("enabled", "adaptive")
    stops = list(req.stop_sequences or [])
    gen = gw.generator
    call = gen.prepare(
        caller.session,
        "anthropic.messages",
        body,
        msgs,
        tools if use_tools else [],
        max_tokens=req.max_tokens,
        sampling={
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stop": stops,
        },
        parse_tools=use_tools,
        parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
        template_kwargs=kwargs,
        metadata=call_metadata(request),
    )
    mid = "msg_" + secrets.token_hex(12)
    headers = turn_headers(call)
    if req.stream:
        stream = ChatStream(gen, call)
        await stream.start()
        events = live_events(mid, req.model, stream)
        return sse(events, done=False, on_close=stream.close, headers=headers)
    async with in_call(gw, caller):
        (output,) = await gen.generate(call.prompt.ids, call.params)
        gen.count_tokens(len(call.prompt.ids), [output])
        c = gen.finish_choice(call, output)
        gen.record_choice(call, 0, c)
    reason = stop_reason(c)
    return JSONResponse(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content_blocks(c),
            "stop_reason": reason,
            "stop_sequence": c.matched_stop if reason == "stop_sequence" else None,
            "usage": usage_of(len(call.prompt.ids), len(c.ids)),
        },
        headers=headers,
    )


def usage_of(prompt_len: int, output_len: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_len,
        "output_tokens": output_len,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


async def live_events(
    mid: str, model: str, stream: ChatStream
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Anthropic's named SSE events as the completion is sampled."""
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_of(stream.prompt_len, 0),
            },
        },
    )
    yield "ping", {"type": "ping"}
    index = 0
    kind: str | None = None  # the block that is open
    had_text = False

    def start(block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        nonlocal kind
        kind = block["type"]
        return "content_block_start", {
            "type": "content_block_start",
            "index": index,
            "content_block": block,
        }

    def delta(d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}

    def stop() -> tuple[str, dict[str, Any]]:
        nonlocal kind, index
        kind = None
        index += 1
        return "content_block_stop", {"type": "content_block_stop", "index": index - 1}

    try:
        async for ev in stream.events():
            if ev.reasoning:
                if kind is None:
                    yield start({"type": "thinking", "thinking": "", "signature": ""})
                yield delta({"type": "thinking_delta", "thinking": ev.reasoning})
            if (ev.content or ev.done is not None) and kind == "thinking":
                yield delta({"type": "signature_delta", "signature": ""})
                yield stop()
            if ev.content:
                if kind is None:
                    had_text = True
                    yield start({"type": "text", "text": ""})
                yield delta({"type": "text_delta", "text": ev.content})
            c = ev.done
            if c is None:
                continue
            if not had_text and not c.tool_calls:
                yield start({"type": "text", "text": ""})  # an empty answer is one empty block
            if kind == "text":
                yield stop()
            for t in c.tool_calls:
                yield start({"type": "tool_use", "id": t.id, "name": t.name, "input": {}})
                args = json.dumps(t.arguments_obj(), ensure_ascii=False)
                yield delta({"type": "input_json_delta", "partial_json": args})
                yield stop()
            reason = stop_reason(c)
            yield (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": reason,
                        "stop_sequence": c.matched_stop if reason == "stop_sequence" else None,
                    },
                    "usage": {"output_tokens": len(c.ids)},
                },
            )
            yield "message_stop", {"type": "message_stop"}
    except GatewayError as err:
        yield "error", error_body("anthropic", err.status, err.message)
