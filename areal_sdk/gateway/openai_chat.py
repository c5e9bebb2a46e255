"""``POST /v1/chat/completions`` in OpenAI's wire format, streaming (SSE) or not.

Tools are rendered by the chat template and tool calls parsed from the completion text; there
is no constrained decoding, so ``tool_choice="required"`` or a named function is a request the
model may not follow (``"none"`` leaves the tools out of the prompt). Streaming is live
(``live.py``): content and reasoning deltas go out as the engine samples them; tool calls,
which are parsed from the whole completion, come in the last chunks of their choice.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from areal_sdk.gateway.conversation import Message, Tool, ToolCall
from areal_sdk.gateway.errors import GatewayError, error_body, unsupported
from areal_sdk.gateway.generation import ChatCall, Generator, Sampled
from areal_sdk.gateway.live import ChatStream
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


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(BaseModel):
    """Every field of OpenAI's chat request that this server reads or tolerates."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int | None = Field(1, ge=1, le=64)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # Accepted and ignored: they change nothing about sampling.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # Refused when set (see _check_unsupported).
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Engine extras, named as in SGLang and vLLM.
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None


def check_unsupported(req: Any, names: tuple[str, ...]) -> None:
    """A field that would change the output but that this server cannot honour is a 400."""
    for name in names:
        value = getattr(req, name, None)
        if value in (None, 0, 0.0, {}, [], False):
            continue
        raise unsupported(name)


def text_of(content: Any, where: str, *, allowed: tuple[str, ...] = ("text",)) -> str:
    """Plain text from a string or a list of content parts; other part types are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(
            400,
            f"Invalid value for '{where}': expected a string or a list of content parts",
            param=where,
            code="invalid_value",
        )
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise unsupported(
                f"{where}[{i}].type", f"Only text content is supported, got {kind!r}."
            )
        out.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(out)


def messages_from_openai(raw: list[dict[str, Any]]) -> list[Message]:
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise GatewayError(
                400, f"'{where}' must be an object", param=where, code="invalid_value"
            )
        role = m.get("role")
        if role in ("system", "developer"):
            messages.append(Message("system", text_of(m.get("content"), f"{where}.content")))
        elif role == "user":
            messages.append(Message("user", text_of(m.get("content"), f"{where}.content")))
        elif role == "assistant":
            if m.get("function_call"):
                raise unsupported(f"{where}.function_call", "Use tool_calls.")
            calls = []
            for j, c in enumerate(m.get("tool_calls") or []):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise GatewayError(
                        400,
                        f"'{where}.tool_calls[{j}]' needs function.name",
                        param=f"{where}.tool_calls[{j}]",
                        code="invalid_value",
                    )
                args = fn.get("arguments", "{}")
                calls.append(
                    ToolCall(
                        id=str(c.get("id") or ""),
                        name=fn["name"],
                        arguments=args if isinstance(args, str) else json.dumps(args),
                    )
                )
            content = text_of(m.get("content"), f"{where}.content", allowed=("text", "refusal"))
            messages.append(Message("assistant", content, tool_calls=calls))
        elif role == "tool":
            if not m.get("tool_call_id"):
                raise GatewayError(
                    400,
                    f"'{where}.tool_call_id' is required for tool messages",
                    param=f"{where}.tool_call_id",
                    code="missing_required_parameter",
                )
            messages.append(
                Message(
                    "tool",
                    text_of(m.get("content"), f"{where}.content"),
                    tool_call_id=str(m["tool_call_id"]),
                    name=m.get("name"),
                )
            )
        else:
            raise GatewayError(
                400,
                f"Invalid value for '{where}.role': {role!r}",
                param=f"{where}.role",
                code="invalid_value",
            )
    return messages


def tools_and_choice(tools: list[Tool], choice: Any, param: str = "tool_choice") -> bool:
    """Whether tools go into the prompt and calls are parsed; checks a named choice."""
    if choice is None or choice in ("auto", "required"):
        return bool(tools)
    if choice == "none":
        return False
    name = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
    if not name:
        raise GatewayError(
            400, f"Invalid value for '{param}': {choice!r}", param=param, code="invalid_value"
        )
    if name not in {t.name for t in tools}:
        raise GatewayError(
            400,
            f"'{param}' names function {name!r}, which is not in tools",
            param=param,
            code="invalid_value",
        )
    return True


TopLogprobs = list[list[tuple[int, float]]] | None


def token_entries(
    gen: Generator, ids: list[int], logprobs: list[float], top: TopLogprobs
) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob objects, with the ``top_logprobs`` alternatives."""
    entries = []
    for i, (text, lp) in enumerate(zip(gen.token_texts(ids), logprobs, strict=False)):
        alts: list[dict[str, Any]] = []
        if top is not None and i < len(top):
            alt_texts = gen.token_texts([t for t, _ in top[i]])
            alts = [
                {"token": t, "logprob": float(v), "bytes": list(t.encode())}
                for t, (_, v) in zip(alt_texts, top[i], strict=True)
            ]
        entries.append(
            {
                "token": text,
                "logprob": float(lp),
                "bytes": list(text.encode()),
                "top_logprobs": alts,
            }
        )
    return entries


def logprob_entries(gen: Generator, choice: Sampled) -> list[dict[str, Any]]:
    """Per-token logprobs for the returned tokens (the end-of-turn token excluded)."""
    out = choice.output
    n = len(out.output_ids)
    if n and out.output_ids[-1] in gen.builder.end_ids:
        n -= 1
    top = None if out.top_logprobs is None else out.top_logprobs[:n]
    return token_entries(gen, out.output_ids[:n], out.logprobs[:n], top)


def usage_of(prompt_len: int, choices: list[Sampled]) -> dict[str, Any]:
    completion = sum(len(c.ids) for c in choices)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


def tool_call_json(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


@router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body(ChatRequest))
async def chat_completions(request: Request) -> Response:
    gw = gateway_of(request)
    caller = authenticate(request, "openai")
    body = await read_json(request)
    req = parse(ChatRequest, body)
    check_unsupported(
        req,
        (
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "audio",
            "prediction",
            "web_search_options",
            "functions",
            "function_call",
        ),
    )
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise unsupported("response_format", "Only {'type': 'text'} is supported.")
    if req.modalities and req.modalities != ["text"]:
        raise unsupported("modalities", "Only ['text'] is supported.")
    if req.top_logprobs and not req.logprobs:
        raise GatewayError(
            400,
            "Invalid value for 'top_logprobs': 'logprobs' must be set to true to use it.",
            param="top_logprobs",
            code="invalid_value",
        )
    metadata = call_metadata(request)
    messages = messages_from_openai(req.messages)
    tools = [
        Tool(
            t.function.name,
            t.function.description or "",
            t.function.parameters or {"type": "object", "properties": {}},
        )
        for t in req.tools or []
    ]
    use_tools = tools_and_choice(tools, req.tool_choice)
    gen = gw.generator
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    call = gen.prepare(
        caller.session,
        "openai.chat",
        body,
        messages,
        tools if use_tools else [],
        max_tokens=req.max_completion_tokens or req.max_tokens,
        sampling={
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "n": req.n,
            "stop": stops,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "top_logprobs_num": req.top_logprobs if req.logprobs else None,
        },
        parse_tools=use_tools,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        template_kwargs=req.chat_template_kwargs,
        metadata=metadata,
    )
    rid = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    headers = turn_headers(call)
    if req.stream:
        stream = ChatStream(gen, call)
        await stream.start()
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        events = live_chunks(gen, rid, created, req, stream, include_usage)
        return sse(events, done=True, on_close=stream.close, headers=headers)
    async with in_call(gw, caller):
        outputs = await gen.generate(call.prompt.ids, call.params)
        gen.count_tokens(len(call.prompt.ids), outputs)
        result_choices = [gen.finish_choice(call, o) for o in outputs]
        for i, c in enumerate(result_choices):
            gen.record_choice(call, i, c)  # before the call ends, so /end waits for it
    choices = []
    for i, c in enumerate(result_choices):
        message: dict[str, Any] = {
            "role": "assistant",
            "content": c.content if (c.content or not c.tool_calls) else None,
            "refusal": None,
        }
        if c.tool_calls:
            message["tool_calls"] = [tool_call_json(t) for t in c.tool_calls]
        if c.reasoning is not None:
            message["reasoning_content"] = c.reasoning
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "finish_reason": c.finish_reason,
            "logprobs": {"content": logprob_entries(gen, c), "refusal": None}
            if req.logprobs
            else None,
        }
        if req.return_token_ids:
            choice["token_ids"] = c.ids
        choices.append(choice)
    payload: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage_of(len(call.prompt.ids), result_choices),
        "system_fingerprint": None,
    }
    if req.return_token_ids:
        payload["prompt_token_ids"] = call.prompt.ids
    return JSONResponse(payload, headers=headers)


def turn_headers(call: ChatCall) -> dict[str, str]:
    """Which episode and turns a call is recorded as (for per-turn rewards)."""
    if call.session is None:
        return {}
    return {
        "x-areal-episode-id": call.session.episode.id,
        "x-areal-turn-ids": ",".join(call.turn_ids),
    }


async def live_chunks(
    gen: Generator,
    rid: str,
    created: int,
    req: ChatRequest,
    stream: ChatStream,
    include_usage: bool,
) -> AsyncIterator[tuple[None, dict[str, Any]]]:
    """``chat.completion.chunk`` events as the choices are sampled."""
    base: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": req.model,
        "system_fingerprint": None,
    }
    if include_usage:
        base["usage"] = None
    pending: dict[int, list[dict[str, Any]]] = {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        # Each chunk carries the logprobs of the tokens that arrived since the previous one.
        entries = pending.pop(index, None)
        lp = {"content": entries, "refusal": None} if entries else None
        return {
            **base,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}],
        }

    for i in range(len(stream.choices)):
        yield None, chunk(i, {"role": "assistant", "content": ""})
    try:
        async for ev in stream.events():
            i = ev.index
            if req.logprobs and ev.ids:
                pending.setdefault(i, []).extend(
                    token_entries(gen, ev.ids, ev.logprobs, ev.top_logprobs)
                )
            if ev.reasoning:
                yield None, chunk(i, {"reasoning_content": ev.reasoning})
            if ev.content:
                yield None, chunk(i, {"content": ev.content})
            if ev.done is None:
                continue
            for j, t in enumerate(ev.done.tool_calls):
                yield None, chunk(i, {"tool_calls": [{"index": j, **tool_call_json(t)}]})
            yield None, chunk(i, {}, finish=ev.done.finish_reason)
    except GatewayError as err:
        yield None, error_body("openai", err.status, err.message, code=err.code, param=err.param)
        return
    if include_usage:
        done = [c for c in stream.choices if c is not None]
        yield None, {**base, "choices": [], "usage": usage_of(stream.prompt_len, done)}
