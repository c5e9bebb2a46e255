"""SGLang's native ``/generate`` request and response shapes, parsed and built strictly.

The request mirrors SGLang's ``GenerateReqInput`` (``managers/io_struct.py``): every field
may be a scalar or, for a batch, a list. Unknown top-level keys and unknown
``sampling_params`` keys are rejected with a message naming the key, so a client's typo does
not silently change sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from areal_sdk.inference import GenerateOutput, SamplingParams

# SGLang keys we accept and act on, mapped to SamplingParams fields.
_RENAMED = {"sampling_seed": "seed"}
# SGLang keys accepted for compatibility, used only by the server's text output.
_TEXT_KEYS = {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"}
# SGLang keys accepted only at their neutral value (the engine does not implement them).
_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "custom_params": None,
    "logit_bias": None,
}


class ProtocolError(ValueError):
    """A malformed request; the message names the offending field (HTTP 400)."""


class GenerateRequest(BaseModel):
    """SGLang's ``GenerateReqInput``, the fields the embedded engine serves."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    log_metrics: bool = True


@dataclass
class TextOptions:
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class OneRequest:
    """One prompt of a (possibly batched) request, with its parsed sampling."""

    index: int
    input_ids: list[int] | None
    text: str | None
    sampling: SamplingParams
    text_options: TextOptions
    return_logprob: bool
    logprob_start_len: int
    rid: str | None


def parse_sampling(raw: dict[str, Any] | None) -> tuple[SamplingParams, TextOptions]:
    """SGLang ``sampling_params`` -> (SamplingParams, text options); ProtocolError if bad."""
    raw = dict(raw or {})
    options = TextOptions()
    for key in _TEXT_KEYS:
        if key in raw:
            value = raw.pop(key)
            if not isinstance(value, bool):
                raise ProtocolError(f"sampling_params.{key} must be a boolean, got {value!r}")
            if hasattr(options, key):
                setattr(options, key, value)
    for key, neutral in _NEUTRAL.items():
        if key in raw:
            value = raw.pop(key)
            if value != neutral and value is not None:
                raise ProtocolError(
                    f"sampling_params.{key}={value!r} is not supported by the embedded engine "
                    f"(only {neutral!r})"
                )
    for old, new in _RENAMED.items():
        if old in raw:
            if new in raw:
                raise ProtocolError(f"sampling_params has both {old} and {new}")
            raw[new] = raw.pop(old)
    if "max_tokens" in raw:
        raise ProtocolError(
            "sampling_params.max_tokens is unknown here; SGLang's name is max_new_tokens"
        )
    try:
        return SamplingParams.model_validate(raw), options
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ProtocolError(f"unknown sampling_params key {key!r}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise ProtocolError(f"sampling_params.{key}: {msg} (got {err.get('input')!r})") from None


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries but the batch has {n} prompts")
        return value
    return [value] * n


def split_request(req: GenerateRequest) -> tuple[list[OneRequest], bool]:
    """Expand a request into one entry per prompt (and per ``n``). Returns (entries, batched)."""
    if (req.text is None) == (req.input_ids is None):
        raise ProtocolError("give exactly one of text or input_ids")
    if req.input_ids is not None:
        ids = req.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts_ids: list[list[int] | None] = list(ids) if batched else [ids]  # type: ignore[list-item]
        prompts_text: list[str | None] = [None] * len(prompts_ids)
    else:
        batched = isinstance(req.text, list)
        prompts_text = list(req.text) if batched else [req.text]  # type: ignore[arg-type]
        prompts_ids = [None] * len(prompts_text)
    n = len(prompts_ids)
    if n == 0:
        raise ProtocolError("the batch is empty")
    sampling = _as_list(req.sampling_params, n, "sampling_params")
    logprob = _as_list(req.return_logprob, n, "return_logprob")
    start = _as_list(req.logprob_start_len, n, "logprob_start_len")
    top = _as_list(req.top_logprobs_num, n, "top_logprobs_num")
    if any(not 0 <= int(t) <= 20 for t in top):
        raise ProtocolError("top_logprobs_num must be between 0 and 20")
    if isinstance(req.rid, list) and not batched:
        raise ProtocolError("rid is a list but the request has one prompt")
    rids = _as_list(req.rid, n, "rid") if req.rid is not None else [None] * n
    if batched and req.rid is not None and not isinstance(req.rid, list):
        rids = [f"{req.rid}-{i}" for i in range(n)]
    entries: list[OneRequest] = []
    for i in range(n):
        params, options = parse_sampling(sampling[i])
        copies = params.n
        one = params.model_copy(update={"n": 1, "top_logprobs_num": int(top[i])})
        for j in range(copies):
            seed = None if one.seed is None else one.seed + j
            rid = rids[i] if copies == 1 or rids[i] is None else f"{rids[i]}-{j}"
            entries.append(
                OneRequest(
                    index=len(entries),
                    input_ids=prompts_ids[i],
                    text=prompts_text[i],
                    sampling=one.model_copy(update={"seed": seed}),
                    text_options=options,
                    return_logprob=bool(logprob[i]),
                    logprob_start_len=int(start[i]),
                    rid=rid,
                )
            )
    return entries, batched or len(entries) > 1


def finish_reason_json(out: GenerateOutput | None, *, message: str = "") -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` object."""
    if out is None:
        return None
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    return {"type": "abort", "message": message or "aborted", "status_code": 200, "err_type": None}
