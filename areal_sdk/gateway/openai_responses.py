"""``POST /v1/responses``: OpenAI's Responses API, non-streaming and streaming events.

Input items (messages, ``function_call``, ``function_call_output``) become the gateway's
conversation; ``previous_response_id`` prepends a stored conversation of the same session
(responses are kept per session, so one episode cannot continue another's). The output is
a list of ``reasoning``, ``message`` and ``function_call`` items. Streaming is live
(``live.py``): reasoning and output text deltas as they are sampled, function calls at the end.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from areal_sdk.gateway.conversation import Message, Tool, ToolCall
from areal_sdk.gateway.errors import GatewayError, unsupported
from areal_sdk.gateway.generation import Generator, Sampled
from areal_sdk.gateway.live import ChatStream
from areal_sdk.gateway.openai_chat import (
    check_unsupported,
    logprob_entries,
    token_entries,
    tools_and_choice,
    turn_headers,
)
from areal_sdk.gateway.state import (
    Caller,
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

# Responses kept for previous_response_id by calls that belong to no session (admin token).
_ADMIN_RESPONSES = 256


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    # Accepted and ignored.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    # Refused when set.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"Invalid value for '{where}'", param=where, code="invalid_value")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise unsupported(
                f"{where}[{i}].type", f"Only text content is supported, got {kind!r}."
            )
        out.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(out)


def messages_from_input(items: str | list[dict[str, Any]]) -> list[Message]:
    if isinstance(items, str):
        return [Message("user", items)]
    messages: list[Message] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise GatewayError(
                400, f"'{where}' must be an object", param=where, code="invalid_value"
            )
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise GatewayError(
                    400,
                    f"Invalid value for '{where}.role': {role!r}",
                    param=f"{where}.role",
                    code="invalid_value",
                )
            role = "system" if role == "developer" else role
            messages.append(Message(role, _text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            call = ToolCall(
                id=str(item.get("call_id", "")),
                name=str(item.get("name", "")),
                arguments=str(item.get("arguments", "{}")),
            )
            # Calls of one turn follow its message item (or each other): one assistant message.
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls.append(call)
            else:
                messages.append(Message("assistant", "", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                Message(
                    "tool",
                    output if isinstance(output, str) else _text(output, f"{where}.output"),
                    tool_call_id=str(item.get("call_id", "")),
                )
            )
        elif kind == "reasoning":
            continue  # the sampled ids carry the reasoning
        else:
            raise unsupported(f"{where}.type", f"Got {kind!r}.")
    return messages


def tools_from(raw: list[dict[str, Any]] | None) -> list[Tool]:
    tools = []
    for i, t in enumerate(raw or []):
        if t.get("type") != "function":
            raise unsupported(
                f"tools[{i}].type", f"Only function tools are supported, got {t.get('type')!r}."
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise GatewayError(
                400,
                f"Missing required parameter: 'tools[{i}].name'",
                param=f"tools[{i}].name",
                code="missing_required_parameter",
            )
        tools.append(
            Tool(
                t["name"],
                t.get("description") or "",
                t.get("parameters") or {"type": "object", "properties": {}},
            )
        )
    return tools


def _stored(request: Request) -> dict[str, list[Message]]:
    store = getattr(request.app.state, "admin_responses", None)
    if store is None:
        store = request.app.state.admin_responses = {}
    return store


def output_items(
    gen: Generator, c: Sampled, with_logprobs: bool, ids: dict[str, str]
) -> list[dict[str, Any]]:
    """The output items of a completion; ``ids`` names the reasoning and message items."""
    items: list[dict[str, Any]] = []
    status = "incomplete" if c.finish_reason == "length" else "completed"
    if c.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": ids["reasoning"],
                "summary": [],
                "content": [{"type": "reasoning_text", "text": c.reasoning}],
                "status": status,
            }
        )
    if c.content or not c.tool_calls:
        part: dict[str, Any] = {"type": "output_text", "text": c.content, "annotations": []}
        part["logprobs"] = logprob_entries(gen, c) if with_logprobs else []
        items.append(
            {
                "type": "message",
                "id": ids["message"],
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        )
    for t in c.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + secrets.token_hex(12),
                "call_id": t.id,
                "name": t.name,
                "arguments": t.arguments,
                "status": "completed",
            }
        )
    return items


@router.post("/v1/responses", response_model=None, openapi_extra=json_body(ResponsesRequest))
async def responses(request: Request) -> Response:
    gw = gateway_of(request)
    caller: Caller = authenticate(request, "openai")
    body = await read_json(request)
    req = parse(ResponsesRequest, body)
    check_unsupported(req, ("background", "conversation", "prompt"))
    with_logprobs = "message.output_text.logprobs" in (req.include or [])
    if req.top_logprobs and not with_logprobs:
        raise GatewayError(
            400,
            "Invalid value for 'top_logprobs': include 'message.output_text.logprobs' to use it.",
            param="top_logprobs",
            code="invalid_value",
        )
    fmt = ((req.text or {}).get("format") or {}).get("type", "text")
    if fmt != "text":
        raise unsupported("text.format", "Only {'type': 'text'} is supported.")
    stored = caller.session.responses if caller.session is not None else _stored(request)
    history: list[Message] = []
    if req.previous_response_id is not None:
        if req.previous_response_id not in stored:
            raise GatewayError(
                404,
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = list(stored[req.previous_response_id])
    convo = history + messages_from_input(req.input)
    messages = ([Message("system", req.instructions)] if req.instructions else []) + convo
    tools = tools_from(req.tools)
    use_tools = tools_and_choice(tools, req.tool_choice)
    gen = gw.generator
    call = gen.prepare(
        caller.session,
        "openai.responses",
        body,
        messages,
        tools if use_tools else [],
        max_tokens=req.max_output_tokens,
        sampling={
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_logprobs_num": req.top_logprobs if with_logprobs else None,
        },
        parse_tools=use_tools,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        metadata=call_metadata(request),
    )
    resp_id = "resp_" + secrets.token_hex(16)
    item_ids = {
        "reasoning": "rs_" + secrets.token_hex(12),
        "message": "msg_" + secrets.token_hex(12),
    }
    created_at = time.time()

    def payload_of(c: Sampled) -> dict[str, Any]:
        if caller.session is not None:
            caller.session.remember_response(resp_id, [*convo, c.reply()])
        else:
            stored[resp_id] = [*convo, c.reply()]
            while len(stored) > _ADMIN_RESPONSES:
                stored.pop(next(iter(stored)))
        items = output_items(gen, c, with_logprobs, item_ids)
        return response_payload(req, resp_id, created_at, c, items, len(call.prompt.ids))

    headers = turn_headers(call)
    if req.stream:
        stream = ChatStream(gen, call)
        await stream.start()
        pending = response_payload(req, resp_id, created_at, None, [], len(call.prompt.ids))
        events = live_events(gen, stream, pending, item_ids, with_logprobs, payload_of)
        return sse(events, done=False, on_close=stream.close, headers=headers)
    async with in_call(gw, caller):
        (output,) = await gen.generate(call.prompt.ids, call.params)
        gen.count_tokens(len(call.prompt.ids), [output])
        c = gen.finish_choice(call, output)
        gen.record_choice(call, 0, c)
    return JSONResponse(payload_of(c), headers=headers)


def response_payload(
    req: ResponsesRequest,
    resp_id: str,
    created_at: float,
    c: Sampled | None,
    items: list[dict[str, Any]],
    n_prompt: int,
) -> dict[str, Any]:
    """The ``response`` object; ``c`` None: still in progress."""
    cut = c is not None and c.finish_reason == "length"
    n_out = len(c.ids) if c is not None else 0
    status = "in_progress" if c is None else ("incomplete" if cut else "completed")
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": items,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": {"format": {"type": "text"}},
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "store": req.store is not False,
        "usage": None
        if c is None
        else {
            "input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + n_out,
        },
    }


async def live_events(
    gen: Generator,
    stream: ChatStream,
    pending: dict[str, Any],
    item_ids: dict[str, str],
    with_logprobs: bool,
    payload_of: Callable[[Sampled], dict[str, Any]],
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The Responses API's streaming events as the completion is sampled."""
    seq = 0

    def emit(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        nonlocal seq
        seq += 1
        return kind, {"type": kind, "sequence_number": seq - 1, **fields}

    yield emit("response.created", response=pending)
    yield emit("response.in_progress", response=pending)
    index = -1
    is_open: str | None = None  # "reasoning" or "message"
    reasoning, text = "", ""
    entries: list[dict[str, Any]] = []  # logprobs not yet sent with a text delta
    rs, ms = item_ids["reasoning"], item_ids["message"]

    def reasoning_item(status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": reasoning}] if status != "in_progress" else []
        return {"type": "reasoning", "id": rs, "summary": [], "content": content, "status": status}

    def open_message() -> list[tuple[str, dict[str, Any]]]:
        nonlocal is_open, index
        is_open, index = "message", index + 1
        item = {"type": "message", "id": ms, "status": "in_progress", "role": "assistant"}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            emit("response.output_item.added", output_index=index, item={**item, "content": []}),
            emit(
                "response.content_part.added",
                item_id=ms,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def close_reasoning() -> list[tuple[str, dict[str, Any]]]:
        nonlocal is_open
        is_open = None
        return [
            emit(
                "response.reasoning_text.done",
                item_id=rs,
                output_index=index,
                content_index=0,
                text=reasoning,
            ),
            emit("response.output_item.done", output_index=index, item=reasoning_item("completed")),
        ]

    try:
        async for ev in stream.events():
            if with_logprobs and ev.ids:
                entries += token_entries(gen, ev.ids, ev.logprobs, ev.top_logprobs)
            if ev.reasoning:
                if is_open is None:
                    is_open, index = "reasoning", index + 1
                    yield emit(
                        "response.output_item.added",
                        output_index=index,
                        item=reasoning_item("in_progress"),
                    )
                reasoning += ev.reasoning
                yield emit(
                    "response.reasoning_text.delta",
                    item_id=rs,
                    output_index=index,
                    content_index=0,
                    delta=ev.reasoning,
                )
            if is_open == "reasoning" and (ev.content or ev.done is not None):
                for e in close_reasoning():
                    yield e
            if ev.content:
                if is_open is None:
                    for e in open_message():
                        yield e
                text += ev.content
                yield emit(
                    "response.output_text.delta",
                    item_id=ms,
                    output_index=index,
                    content_index=0,
                    delta=ev.content,
                    logprobs=entries,
                )
                entries = []
            c = ev.done
            if c is None:
                continue
            payload = payload_of(c)
            for item in payload["output"]:
                if item["type"] == "message":
                    if is_open != "message":
                        for e in open_message():
                            yield e
                    part = item["content"][0]
                    yield emit(
                        "response.output_text.done",
                        item_id=ms,
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    )
                    yield emit(
                        "response.content_part.done",
                        item_id=ms,
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                    yield emit("response.output_item.done", output_index=index, item=item)
                    is_open = None
                elif item["type"] == "function_call":
                    index += 1
                    yield emit(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""},
                    )
                    yield emit(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["arguments"],
                    )
                    yield emit(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                        name=item["name"],
                    )
                    yield emit("response.output_item.done", output_index=index, item=item)
            done = (
                "response.completed" if payload["status"] == "completed" else "response.incomplete"
            )
            yield emit(done, response=payload)
    except GatewayError as err:
        yield emit("error", code=err.code, message=err.message, param=err.param)
