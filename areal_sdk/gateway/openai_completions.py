"""``POST /v1/completions``: OpenAI's legacy text completions, prompt as text or token ids.

No chat template is applied. Inside an episode, a prompt that starts with an earlier call's
prompt plus its completion (a hand-rolled multi-turn loop) reuses that call's ids, so only
the new text is tokenized.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from areal_sdk.gateway.errors import GatewayError, unsupported
from areal_sdk.gateway.generation import Generator
from areal_sdk.gateway.openai_chat import check_unsupported
from areal_sdk.gateway.sessions import Session
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
from areal_sdk.inference import GenerateOutput

router = APIRouter()


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    suffix: str | None = None
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None


def prompts_of(req: CompletionRequest, gen: Generator) -> list[tuple[str, list[int] | None]]:
    """(text, ids) per prompt; ids are given when the client sent token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [(p, None)]
    if not p:
        raise GatewayError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(x, str) for x in p):
        return [(x, None) for x in p]
    batch = [p] if all(isinstance(x, int) for x in p) else p
    vocab = getattr(gen.backend, "vocab_size", None) or len(gen.tokenizer)
    for ids in batch:
        bad = [t for t in ids if not 0 <= t < vocab]  # type: ignore[operator]
        if not ids or bad:
            what = f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})" if bad else ""
            raise GatewayError(
                400,
                f"Invalid value for 'prompt': {what or 'a token-id prompt is empty'}",
                param="prompt",
                code="invalid_value",
            )
    return [(gen.tokenizer.decode(x, skip_special_tokens=False), list(x)) for x in batch]  # type: ignore[arg-type]


def prompt_ids_for(gen: Generator, session: Session | None, text: str) -> list[int]:
    """Token ids for a text prompt, continuing this episode's sampled ids where it can."""
    best: tuple[str, list[int]] | None = None
    for done_text, done_ids in session.text_history if session else []:
        if text.startswith(done_text) and (best is None or len(done_text) > len(best[0])):
            best = (done_text, done_ids)
    if best is None or not best[0]:
        return list(gen.tokenizer(text)["input_ids"])
    gen.metrics.history_merges.inc()
    return [*best[1], *gen.builder.encode(text[len(best[0]) :])]


def top_logprobs_of(gen: Generator, toks: list[str], out: GenerateOutput) -> list[dict[str, float]]:
    """Per position, the ``logprobs`` most likely tokens and the sampled one (so up to
    ``logprobs + 1`` entries, as OpenAI documents), text -> logprob."""
    rows = []
    for i, (tok, lp) in enumerate(zip(toks, out.logprobs, strict=True)):
        row: dict[str, float] = {}
        if out.top_logprobs is not None:
            alts = out.top_logprobs[i]
            for text, (_, v) in zip(gen.token_texts([t for t, _ in alts]), alts, strict=True):
                row.setdefault(text, float(v))  # tokens that decode alike keep the likeliest
        row.setdefault(tok, float(lp))
        rows.append(row)
    return rows


@router.post("/v1/completions", response_model=None, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    gw = gateway_of(request)
    caller = authenticate(request, "openai")
    body = await read_json(request)
    req = parse(CompletionRequest, body)
    check_unsupported(req, ("suffix", "frequency_penalty", "presence_penalty", "logit_bias"))
    if req.best_of not in (None, 1, req.n):
        raise unsupported("best_of", "Only best_of == n is supported.")
    metadata = call_metadata(request)
    gen = gw.generator
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    rid = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())
    choices: list[dict[str, Any]] = []
    total_prompt = total_completion = 0
    turn_ids: list[str] = []
    async with in_call(gw, caller):
        for text, given in prompts_of(req, gen):
            ids = given if given is not None else prompt_ids_for(gen, caller.session, text)
            params = gen.sampling(
                len(ids),
                req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                n=req.n,
                stop=stops,
                seed=req.seed,
                top_k=req.top_k,
                min_p=req.min_p,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                top_logprobs_num=req.logprobs or None,
            )
            outputs = await gen.generate(ids, params)
            gen.count_tokens(len(ids), outputs)
            total_prompt += len(ids)
            for out in outputs:
                sampled = gen.finish(out, stops, parse_tools=False)
                total_completion += len(out.output_ids)
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "text": (text if req.echo else "") + sampled.text,
                    "finish_reason": sampled.finish_reason,
                    "logprobs": None,
                }
                if req.logprobs is not None:
                    toks = gen.token_texts(out.output_ids)
                    offsets, pos = [], len(text) if req.echo else 0
                    for t in toks:
                        offsets.append(pos)
                        pos += len(t)
                    choice["logprobs"] = {
                        "tokens": toks,
                        "token_logprobs": list(out.logprobs),
                        "top_logprobs": top_logprobs_of(gen, toks, out),
                        "text_offset": offsets,
                    }
                if req.return_token_ids:
                    choice["token_ids"] = out.output_ids
                    choice["prompt_token_ids"] = ids
                choices.append(choice)
                if caller.session is not None:
                    turn = gen.make_turn(
                        "openai.completions",
                        body,
                        ids,
                        out,
                        sampled.finish_reason,
                        {**metadata, "choice": choice["index"]},
                    )
                    gw.sessions.record(caller.session, turn, None)
                    caller.session.text_history.append(
                        (
                            text + gen.tokenizer.decode(out.output_ids, skip_special_tokens=False),
                            [*ids, *out.output_ids],
                        )
                    )
                    turn_ids.append(turn.id)
    usage = {
        "prompt_tokens": total_prompt,
        "completion_tokens": total_completion,
        "total_tokens": total_prompt + total_completion,
    }
    headers = (
        {"x-areal-episode-id": caller.session.episode.id, "x-areal-turn-ids": ",".join(turn_ids)}
        if caller.session
        else {}
    )
    base = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "system_fingerprint": None,
    }
    if not req.stream:
        return JSONResponse({**base, "choices": choices, "usage": usage}, headers=headers)
    events: list[dict[str, Any]] = []
    for c in choices:
        events.append(
            {
                **base,
                "choices": [
                    {
                        "index": c["index"],
                        "text": c["text"],
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
        events.append(
            {
                **base,
                "choices": [
                    {
                        "index": c["index"],
                        "text": "",
                        "logprobs": c["logprobs"],
                        "finish_reason": c["finish_reason"],
                    }
                ],
            }
        )
    if (req.stream_options or {}).get("include_usage"):
        events.append({**base, "choices": [], "usage": usage})
    response = sse(((None, e) for e in events), done=True)
    response.headers.update(headers)
    return response
