"""SGLang's ``/generate`` JSON, built from ``SamplingParams`` and read into ``GenerateOutput``.

Tokens and logprobs come from ``meta_info.output_token_logprobs`` (``[logprob, id, text]``
per token, as slime and AReaL read them). Per-token weight versions come from
``meta_info.output_token_versions`` when the server sends it (the embedded engine does);
a real SGLang server reports one ``weight_version`` per answer, which tags every token of
that answer. That is exact when a weight update only happens while the server is paused in
``abort`` mode (each answer is then sampled under one version).
"""

from __future__ import annotations

from typing import Any

from areal_sdk.inference import FinishReason, GenerateOutput, SamplingParams


def parse_version(value: Any, default: int = 0) -> int:
    """SGLang's ``weight_version`` string as an int (``"3"``, ``"v3"``); ``default`` for
    SGLang's initial ``"default"`` or anything else that is not a number."""
    text = str(value if value is not None else "").strip().removeprefix("v")
    return int(text) if text.isdigit() else default


def sampling_params(sampling: SamplingParams) -> dict[str, Any]:
    """``sampling_params`` for one completion (``n`` is always 1 on the wire)."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def generate_body(input_ids: list[int], sampling: SamplingParams, rid: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params(sampling),
        "return_logprob": True,
        "rid": rid,
        "stream": False,
    }
    top = getattr(sampling, "top_logprobs_num", 0)
    if top:  # SGLang takes it beside sampling_params, not inside
        body["top_logprobs_num"] = top
    return body


def _finish(meta: dict[str, Any]) -> tuple[FinishReason, str | int | None]:
    reason = meta.get("finish_reason")
    if isinstance(reason, str):  # some releases send a bare string
        reason = {"type": reason}
    kind = (reason or {}).get("type", "abort")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def parse_output(data: Any, *, prompt_len: int, server: str) -> GenerateOutput:
    """One ``/generate`` answer as a ``GenerateOutput`` (``meta["server"]`` names the URL)."""
    if isinstance(data, list):  # a batch of one
        data = data[0]
    if not isinstance(data, dict) or "meta_info" not in data:
        raise ValueError(f"SGLang server {server} sent a /generate answer without meta_info")
    meta = data["meta_info"]
    rows = meta.get("output_token_logprobs")
    if rows is None:
        raise ValueError(
            f"SGLang server {server} sent no meta_info.output_token_logprobs "
            "(was return_logprob dropped?)"
        )
    ids = [int(row[1]) for row in rows]
    logprobs = [float(row[0]) for row in rows]
    version = parse_version(meta.get("weight_version"))
    versions = meta.get("output_token_versions")
    if not isinstance(versions, list) or len(versions) != len(ids):
        versions = [version] * len(ids)
    finish, matched = _finish(meta)
    top = meta.get("output_top_logprobs")
    extra: dict[str, Any] = {}
    if isinstance(top, list) and len(top) == len(ids):
        extra["top_logprobs"] = [
            [(int(row[1]), float(row[0])) for row in position or []] for position in top
        ]
    return GenerateOutput(
        output_ids=ids,
        logprobs=logprobs,
        versions=[int(v) for v in versions],
        finish_reason=finish,
        matched_stop=matched,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
        request_id=meta.get("id"),
        meta={"server": server, "weight_version": meta.get("weight_version")},
        **extra,
    )
