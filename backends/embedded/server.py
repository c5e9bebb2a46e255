"""SGLang's native HTTP routes over an ``EmbeddedEngine``, so one SGLang client serves both.

Routes: ``/generate`` (text or input_ids, batched lists, ``n``, return_logprob, SSE stream,
rid), ``/update_weights_from_disk``, ``/update_weights_from_tensor`` (CUDA IPC handles, or
CPU shared memory in one process; ``load_format`` null, ``direct`` or ``flattened_bucket``;
``stage_for_version``/``staged_buckets`` push without a pause, ``weight_stage.py``),
``/update_weight_version``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/flush_cache``, ``/get_model_info``,
``/get_weight_version``, ``/get_server_info``, ``/get_load``, ``/health``,
``/health_generate``, and the weight-update group: ``/init_weights_update_group``,
``/update_weights_from_distributed`` (one broadcast per tensor, gloo on CPU),
``/destroy_weights_update_group``. Bad input answers 400 with ``{"error": {"message": ...}}``; the
engine keeps serving.

>>> app = create_app(engine)            # a FastAPI app
>>> from areal_sdk.server_thread import ServerThread
>>> with ServerThread(app, name="engine-http", lifespan="off", keep_alive_s=KEEP_ALIVE_S) as s:
...     httpx.get(s.url + "/health")
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from areal_sdk.backends.embedded.engine import EmbeddedEngine, EngineInputError
from areal_sdk.backends.embedded.protocol import (
    GenerateRequest,
    OneRequest,
    ProtocolError,
    finish_reason_json,
    split_request,
)
from areal_sdk.backends.embedded.weight_stage import StageError, WeightStage
from areal_sdk.backends.embedded.weights import WeightUpdateError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from areal_sdk.disconnect import CancelOnDisconnect
from areal_sdk.inference import GenerateOutput, PauseMode

# Seconds an idle connection is kept open: above the SGLang client's idle expiry (2 s), so
# the server never closes a connection that a client is about to reuse.
KEEP_ALIVE_S = 30

# How long a weight-group collective may wait for the trainer.
WEIGHT_GROUP_TIMEOUT_S = 300.0


def _error(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "code": status}}, status_code=status
    )


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class UpdateFromDisk(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang adds tuning flags over releases
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateFromTensor(BaseModel):
    model_config = ConfigDict(extra="ignore")
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    # Extensions for a push without a pause (weight_stage.py): a bucket staged for this
    # version, and on the last bucket how many were staged before it.
    stage_for_version: str | None = None
    staged_buckets: int = 0


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: PauseMode = PauseMode.ABORT


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str = ""
    abort_all: bool = False


class InitGroupBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class GroupNameBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group_name: str = "weight_update_group"


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    new_version: str
    abort_all_requests: bool = False


def _parse_version(text: str | None, current: int) -> int:
    if text is None:
        return current + 1
    try:
        return int(str(text).removeprefix("v"))
    except ValueError:
        raise ProtocolError(
            f"weight_version must be an integer (optionally 'v'-prefixed), got {text!r}"
        ) from None


async def _json_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"the body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(body)"
        if err["type"] == "extra_forbidden":
            raise ProtocolError(f"unknown field {key!r}") from None
        raise ProtocolError(f"{key}: {err['msg']}") from None


def create_app(engine: EmbeddedEngine) -> FastAPI:
    """A FastAPI app serving SGLang's native routes over ``engine``."""
    app = FastAPI(title="areal-sdk embedded engine", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_: Request, exc: ProtocolError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(EngineInputError)
    async def _input_error(_: Request, exc: EngineInputError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, str(exc.errors()[0].get("msg", exc)))

    def encode(one: OneRequest) -> list[int]:
        if one.input_ids is not None:
            if not all(isinstance(t, int) for t in one.input_ids):
                raise ProtocolError("input_ids must be integers")
            return list(one.input_ids)
        if tokenizer is None:
            raise ProtocolError("this engine has no tokenizer; send input_ids")
        return tokenizer.encode(one.text or "", add_special_tokens=True)

    def decode(ids: list[int], one: OneRequest) -> str:
        if tokenizer is None:
            return ""
        return tokenizer.decode(ids, skip_special_tokens=one.text_options.skip_special_tokens)

    def response(
        one: OneRequest,
        prompt: list[int],
        out: GenerateOutput | None,
        chunk_ids: list[int],
        chunk_lps: list[float],
        chunk_versions: list[int],
        input_lps: list[float | None] | None,
        started: float,
    ) -> dict[str, Any]:
        text = decode(chunk_ids, one)
        if (
            out is not None
            and out.finish_reason == "stop"
            and isinstance(out.matched_stop, str)
            and not one.text_options.no_stop_trim
        ):
            cut = text.find(out.matched_stop)
            if cut >= 0:
                text = text[:cut]
        meta: dict[str, Any] = {
            "id": one.rid or (out.request_id if out else None),
            "finish_reason": finish_reason_json(out),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(chunk_ids),
            "cached_tokens": 0,
            "weight_version": str(engine.version),
            "e2e_latency": time.monotonic() - started,
            # An extension SGLang lacks: the weight version that sampled each output token.
            "output_token_versions": list(chunk_versions),
        }
        if out is not None:
            meta["num_retractions"] = out.meta.get("retractions", 0)
        if one.return_logprob:
            show = (
                (lambda t: tokenizer.decode([t]))
                if (getattr(one, "_text_lp", False) and tokenizer)
                else (lambda t: None)
            )
            meta["output_token_logprobs"] = [
                [lp, t, show(t)] for lp, t in zip(chunk_lps, chunk_ids, strict=True)
            ]
            tops = out.top_logprobs if out is not None else None
            if tops is not None and len(tops) == len(chunk_ids):
                meta["output_top_logprobs"] = [
                    [[lp, t, show(t)] for t, lp in position] for position in tops
                ]
            if input_lps is not None:
                begin = max(one.logprob_start_len, 0)
                meta["input_token_logprobs"] = [
                    [lp, t, show(t)]
                    for lp, t in zip(input_lps[begin:], prompt[begin:], strict=True)
                ]
        return {"text": text, "output_ids": list(chunk_ids), "meta_info": meta}

    async def run_one(one: OneRequest, prompt: list[int], started: float) -> dict[str, Any]:
        input_lps = (
            await engine.score(prompt)
            if one.return_logprob and one.logprob_start_len >= 0
            else None
        )
        if one.sampling.max_new_tokens == 0:
            out = GenerateOutput(
                [], [], [], "length", prompt_tokens=len(prompt), request_id=one.rid
            )
        else:
            out = await engine.generate(prompt, one.sampling, request_id=one.rid)
        return response(
            one, prompt, out, out.output_ids, out.logprobs, out.versions, input_lps, started
        )

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        started = time.monotonic()
        body = await _json_body(request, GenerateRequest)
        entries, batched = split_request(body)
        for one in entries:
            one._text_lp = body.return_text_in_logprobs  # type: ignore[attr-defined]
        prompts = [encode(one) for one in entries]
        for one, prompt in zip(entries, prompts, strict=True):
            engine.validate(
                prompt, one.sampling
            ) if one.sampling.max_new_tokens else engine.validate(
                prompt, one.sampling.model_copy(update={"max_new_tokens": 0})
            )
        if body.stream:
            return StreamingResponse(
                stream(entries, prompts, batched, started), media_type="text/event-stream"
            )
        results = await asyncio.gather(
            *(run_one(o, p, started) for o, p in zip(entries, prompts, strict=True))
        )
        return JSONResponse(results if batched else results[0])

    async def stream(
        entries: list[OneRequest], prompts: list[list[int]], batched: bool, started: float
    ) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

        async def pump(one: OneRequest, prompt: list[int]) -> None:
            ids: list[int] = []
            lps: list[float] = []
            vers: list[int] = []
            try:
                async for chunk in engine.stream(prompt, one.sampling, request_id=one.rid):
                    ids += chunk.ids
                    lps += chunk.logprobs
                    vers += chunk.versions
                    item = response(one, prompt, chunk.output, ids, lps, vers, None, started)
                    if batched:
                        item["index"] = one.index
                    await queue.put(item)
            except Exception as exc:
                await queue.put(exc)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(o, p)) for o, p in zip(entries, prompts, strict=True)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    yield f"data: {json.dumps({'error': {'message': str(item)}})}\n\n".encode()
                else:
                    yield f"data: {json.dumps(item)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()  # a disconnected client aborts its requests

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _json_body(request, UpdateFromDisk)
        version = _parse_version(body.weight_version, engine.version)
        path = Path(body.model_path)
        if not path.exists():
            return JSONResponse(
                {
                    "success": False,
                    "message": f"model_path {path} does not exist",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        if body.abort_all_requests:
            await engine.abort_all()
        try:
            await engine.update_weights(path, version, flush_cache=body.flush_cache)
        except WeightUpdateError as exc:
            return JSONResponse(
                {"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=400
            )
        return JSONResponse(
            {
                "success": True,
                "message": f"weights loaded from {path} as version {version}",
                "num_paused_requests": 0,
            }
        )

    def _result(success: bool, message: str) -> JSONResponse:
        return JSONResponse(
            {"success": success, "message": message}, status_code=200 if success else 400
        )

    stage = WeightStage()

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        from areal_sdk.backends.weight_sync.cuda_ipc import PayloadError, read_sglang_payload

        body = await _json_body(request, UpdateFromTensor)
        # One payload per TP rank; this engine is one rank.
        if len(body.serialized_named_tensors) != 1:
            return _result(
                False,
                f"serialized_named_tensors holds {len(body.serialized_named_tensors)} payloads; "
                "this engine has 1 TP rank",
            )
        # Without weight_version the bucket keeps the served version (SGLang's behaviour):
        # a push of several buckets names the version on its last one.
        version = (
            engine.version
            if body.weight_version is None
            else _parse_version(body.weight_version, engine.version)
        )
        try:
            named = read_sglang_payload(body.serialized_named_tensors[0], body.load_format)
        except PayloadError as exc:
            return _result(False, str(exc))
        if body.stage_for_version is not None:
            target = _parse_version(body.stage_for_version, engine.version)
            count = len(named)
            await asyncio.to_thread(stage.add, target, dict(named))
            del named  # copied: the sender may free the bucket once this request returns
            return _result(True, f"staged {count} tensors for weight version {target}")
        tensors = dict(named)
        try:
            # Empties the stage: an abandoned push's buckets go with the next load.
            tensors = {**stage.take(version, body.staged_buckets), **tensors}
        except StageError as exc:
            return _result(False, str(exc))
        if body.abort_all_requests:
            await engine.abort_all()
        try:
            await engine.update_weights(tensors, version, flush_cache=body.flush_cache)
        except WeightUpdateError as exc:
            return _result(False, str(exc))
        finally:
            # The tensors are views of the sender's memory: drop them before answering, so
            # the sender may free the bucket once this request returns.
            count = len(tensors)
            del named, tensors
        if body.staged_buckets:
            # The staged copies (a whole model) go back to the card, for the trainer beside
            # this engine.
            await engine.release_cached_memory()
        return _result(True, f"loaded {count} tensors; weight version {engine.version}")

    # -- SGLang's weight-update group: the trainer is rank 0 and broadcasts each tensor -----
    groups: dict[str, Any] = {}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        from areal_sdk.backends.sglang.process_group import init_weight_group

        body = await _json_body(request, InitGroupBody)
        if body.group_name in groups:
            return _result(False, f"weight group {body.group_name!r} already exists")
        # The engine runs on CPU or one GPU: NCCL needs CUDA, gloo serves a CPU engine.
        backend = body.backend if str(engine.runner.device).startswith("cuda") else "gloo"
        try:
            groups[body.group_name] = await asyncio.to_thread(
                init_weight_group,
                backend,
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                body.group_name,
                WEIGHT_GROUP_TIMEOUT_S,
            )
        except Exception as exc:
            return _result(False, f"joining the weight group failed: {exc}")
        return _result(True, f"joined {body.group_name!r} as rank {body.rank_offset}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        from areal_sdk.backends.sglang.process_group import broadcast_from_trainer

        body = await _json_body(request, DistributedBody)
        group = groups.get(body.group_name)
        if group is None:
            return _result(False, f"no weight group {body.group_name!r}; call init first")
        if body.load_format not in (None, "direct"):
            return _result(False, f"load_format {body.load_format!r} is not supported here")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return _result(False, "names, dtypes and shapes differ in length")
        try:
            dtypes = [getattr(torch, d) for d in body.dtypes]
        except AttributeError as exc:
            return _result(False, f"unknown dtype: {exc}")
        # Without weight_version the bucket keeps the served version (SGLang's behaviour).
        version = (
            engine.version
            if body.weight_version is None
            else _parse_version(body.weight_version, engine.version)
        )
        device = engine.runner.device if str(engine.runner.device).startswith("cuda") else "cpu"

        def receive() -> dict[str, torch.Tensor]:
            out = {}
            for name, dtype, shape in zip(body.names, dtypes, body.shapes, strict=True):
                tensor = torch.empty(shape, dtype=dtype, device=device)
                broadcast_from_trainer(group, tensor)  # in the order the trainer sends
                out[name] = tensor
            return out

        try:
            tensors = await asyncio.to_thread(receive)
        except Exception as exc:
            return _result(False, f"receiving the bucket failed: {exc}")
        if body.abort_all_requests:
            await engine.abort_all()
        try:
            await engine.update_weights(tensors, version, flush_cache=body.flush_cache)
        except WeightUpdateError as exc:
            return _result(False, str(exc))
        return _result(True, f"loaded {len(tensors)} tensors")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        from areal_sdk.backends.sglang.process_group import destroy_weight_group

        body = await _json_body(request, GroupNameBody)
        group = groups.pop(body.group_name, None)
        if group is None:
            return _result(False, f"no weight group {body.group_name!r}")
        destroy_weight_group(group)
        return _result(True, f"destroyed {body.group_name!r}")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _json_body(request, VersionBody)
        version = _parse_version(body.new_version, engine.version)
        if body.abort_all_requests:
            await engine.abort_all()
        await engine.set_version(version)
        return JSONResponse({"success": True, "message": f"weight version is {version}"})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await _json_body(request, PauseBody)
        await engine.pause(body.mode)
        return JSONResponse({"message": f"Generation paused ({body.mode.value}).", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await _json_body(request, _Body)
        await engine.resume()
        return JSONResponse({"message": "Generation continued.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request, AbortBody)
        if body.abort_all:
            await engine.abort_all()
        elif body.rid:
            await engine.abort(body.rid)
        else:
            raise ProtocolError("give rid or abort_all")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if await engine.flush_cache():
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details.\n"
            )
        return PlainTextResponse(
            "Cache not flushed: requests are running or queued. Retry when idle.\n", status_code=400
        )

    def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path or engine.model_name,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.version),
            "served_model_name": engine.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
        }

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(model_info())

    @app.get("/get_weight_version")
    async def get_weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": str(engine.version)})

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        info = model_info()
        info.update(await engine.health())
        info["max_running_requests"] = engine.config.max_batch_size
        return JSONResponse(info)

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        return JSONResponse(
            {
                "num_reqs": engine.num_running + engine.num_waiting,
                "num_running_reqs": engine.num_running,
                "num_waiting_reqs": engine.num_waiting,
            }
        )

    @app.api_route("/health", methods=["GET", "POST"])
    async def health() -> Response:
        try:
            await engine.health()
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health_generate() -> Response:
        try:
            await engine.health()
            if engine.num_running == 0 and engine._paused is None:
                from areal_sdk.inference import SamplingParams

                await asyncio.wait_for(engine.generate([0], SamplingParams(max_new_tokens=1)), 60)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    # A client that leaves aborts its generation (as in SGLang) instead of leaving the
    # engine sampling a reply nobody reads.
    app.add_middleware(CancelOnDisconnect)
    return app
