"""``POST /v1/responses``: OpenAI's Responses API, non-streaming and streaming events.

Input items (messages, ``function_call``, ``function_call_output``) become the gateway's
conversation; ``previous_response_id`` prepends a stored conversation of the same session
(responses are kept per session, so one episode cannot continue another's). The output is
a list of ``reasoning``, ``message`` and ``function_call`` items.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from areal_sdk.gateway.conversation import Message, Tool, ToolCall
from areal_sdk.gateway.errors import GatewayError, unsupported
from areal_sdk.gateway.generation import Generator, Sampled
from areal_sdk.gateway.openai_chat import (
    check_unsupported,
    logprob_entries,
    tools_and_choice,
    turn_headers,
)
from areal_sdk.gateway.state import Caller, authenticate, gateway_of, in_call, parse, read_json, sse

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


def output_items(gen: Generator, c: Sampled, with_logprobs: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    status = "incomplete" if c.finish_reason == "length" else "completed"
    if c.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": "rs_" + secrets.token_hex(12),
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
                "id": "msg_" + secrets.token_hex(12),
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


@router.post("/v1/responses", response_model=None)
async def responses(request: Request) -> Response:
    gw = gateway_of(request)
    caller: Caller = authenticate(request, "openai")
    body = await read_json(request)
    req = parse(ResponsesRequest, body)
    check_unsupported(req, ("background", "conversation", "prompt"))
    if req.top_logprobs:
        raise unsupported(
            "top_logprobs", "Only the sampled tokens' logprobs are available (use 0)."
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
    async with in_call(gw, caller):
        result = await gw.generator.chat(
            caller.session,
            "openai.responses",
            body,
            messages,
            tools if use_tools else [],
            max_tokens=req.max_output_tokens,
            sampling={"temperature": req.temperature, "top_p": req.top_p},
            parse_tools=use_tools,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )
    c = result.choices[0]
    resp_id = "resp_" + secrets.token_hex(16)
    if caller.session is not None:
        caller.session.remember_response(resp_id, [*convo, c.reply()])
    else:
        stored[resp_id] = [*convo, c.reply()]
        while len(stored) > _ADMIN_RESPONSES:
            stored.pop(next(iter(stored)))
    with_logprobs = "message.output_text.logprobs" in (req.include or [])
    items = output_items(gw.generator, c, with_logprobs)
    n_prompt, n_out = len(result.prompt.ids), len(c.ids)
    payload = {
        "id": resp_id,
        "object": "response",
        "created_at": time.time(),
        "status": "incomplete" if c.finish_reason == "length" else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"}
        if c.finish_reason == "length"
        else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": items,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": {"format": {"type": "text"}},
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "store": req.store is not False,
        "usage": {
            "input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + n_out,
        },
    }
    headers = turn_headers(caller.session, result.choices)
    if not req.stream:
        return JSONResponse(payload, headers=headers)
    response = sse(stream_events(payload), done=False)
    response.headers.update(headers)
    return response


def stream_events(payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    pending = {
        **payload,
        "status": "in_progress",
        "output": [],
        "usage": None,
        "incomplete_details": None,
    }
    emit("response.created", response=pending)
    emit("response.in_progress", response=pending)
    for index, item in enumerate(payload["output"]):
        iid = item["id"]
        if item["type"] == "message":
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            for ci, part in enumerate(item["content"]):
                emit(
                    "response.content_part.added",
                    item_id=iid,
                    output_index=index,
                    content_index=ci,
                    part={**part, "text": "", "logprobs": []},
                )
                emit(
                    "response.output_text.delta",
                    item_id=iid,
                    output_index=index,
                    content_index=ci,
                    delta=part["text"],
                    logprobs=part.get("logprobs") or [],
                )
                emit(
                    "response.output_text.done",
                    item_id=iid,
                    output_index=index,
                    content_index=ci,
                    text=part["text"],
                    logprobs=part.get("logprobs") or [],
                )
                emit(
                    "response.content_part.done",
                    item_id=iid,
                    output_index=index,
                    content_index=ci,
                    part=part,
                )
        elif item["type"] == "function_call":
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit(
                "response.function_call_arguments.delta",
                item_id=iid,
                output_index=index,
                delta=item["arguments"],
            )
            emit(
                "response.function_call_arguments.done",
                item_id=iid,
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            )
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress"},
            )
        emit("response.output_item.done", output_index=index, item=item)
    emit(
        "response.completed" if payload["status"] == "completed" else "response.incomplete",
        response=payload,
    )
    return events
