"""``SGLangBackend``: the inference backend over one or many SGLang servers' native HTTP API.

Generation goes to one server (least loaded, sticky per episode: see ``pool.py``) or
through an ``sglang-router``; pauses, resumes and weight updates go to every server
directly. A server that stops answering is taken out of rotation and its request is sent
to another one; with none left the call fails with ``NoServerLeft`` naming each server and
its last error. ``health()`` puts a server that answers again back in rotation, once it
serves the current weight version.

>>> backend = SGLangBackend(["http://gpu0:30000", "http://gpu1:30000"], tokenizer=tok)
>>> out = await backend.generate(ids, SamplingParams(max_new_tokens=64), request_id="ep7:0")
>>> await backend.pause(PauseMode.ABORT); await backend.update_weights("/ckpt/v3", 3)
>>> await backend.resume()
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from areal_sdk.backends.sglang.client import ServerClient, ServerUnavailable
from areal_sdk.backends.sglang.pool import NoServerLeft, Server, ServerPool, affinity_key
from areal_sdk.backends.sglang.protocol import generate_body, parse_output, parse_version

from areal_sdk.inference import (
    GenerateOutput,
    InferenceBackend,
    PauseMode,
    SamplingParams,
    WeightSource,
)

if TYPE_CHECKING:
    from areal_sdk.backends.sglang.launcher import SGLangLauncher
    from areal_sdk.backends.weight_sync.base import WeightSync

    from areal_sdk.config import Config

log = logging.getLogger(__name__)
T = TypeVar("T")
# How often an update with no server in rotation looks for a restarted one.
REJOIN_POLL_S = 0.2
# Header sglang-router (SGLang Model Gateway) routes sticky sessions by.
ROUTING_HEADER = "X-SMG-Routing-Key"
PAUSE_POLL_S = 0.02


class SGLangBackend(InferenceBackend):
    """SGLang servers, attached by URL (``inference.urls``) or launched (``launcher``)."""

    def __init__(
        self,
        urls: list[str],
        *,
        tokenizer: Any = None,
        model_name: str = "policy",
        timeout_s: float = 600.0,
        retries: int = 3,
        router_url: str | None = None,
        launcher: SGLangLauncher | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.retries = retries
        self.pool = ServerPool([Server(self._client(u)) for u in urls])
        self.router = (
            ServerClient(router_url, timeout_s=timeout_s, retries=retries) if router_url else None
        )
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.launcher = launcher
        self._version = 0
        self._where: dict[str, Server] = {}  # rid -> the server running it
        # A flag, not an asyncio.Event: the gateway and the trainer call from different loops.
        self._paused = False
        self._pauses = 0  # pause() calls so far: an abort during one is not the caller's
        self._generating: set[str] = set()  # rids of generate() calls under way
        self._aborted: set[str] = set()  # ... that abort() ended
        self._closed = False
        # train.lora: the adapter every request names (SGLang's ``lora_path``); lora.py sets it.
        self.lora_name: str | None = None
        # Where a supervisor restarts dead servers (an engine fleet sets it): how long an update
        # with no server in rotation waits for one to rejoin rather than fail the run.
        self.rejoin_timeout_s = 0.0

    @classmethod
    def from_config(cls, config: Config) -> SGLangBackend:
        """Attach to ``inference.urls``, or launch ``inference.sglang_servers`` servers."""
        from areal_sdk.backends.sglang.launcher import SGLangLauncher

        inference = config.inference
        launcher = None
        urls = list(inference.urls)
        if not urls:
            launcher = SGLangLauncher.from_config(config).start()
            urls = launcher.urls
        try:
            backend = cls(
                urls,
                tokenizer=_load_tokenizer(config),
                model_name=config.model.served_name,
                timeout_s=inference.request_timeout_s,
                retries=inference.retries,
                router_url=inference.router_url,
                launcher=launcher,
            )
            backend.connect()
        except BaseException:
            if launcher is not None:
                launcher.stop()
            raise
        return backend

    # -- setup (blocking: runs before any event loop serves requests) -----------------------

    def connect(self) -> None:
        """Read each server's model info (weight version, TP size); register the workers
        with the router. Raises ``NoServerLeft`` if no server answers."""
        versions = set()
        with httpx.Client(timeout=30) as http:
            for server in self.pool.servers:
                try:
                    info = http.get(server.url + "/get_model_info").raise_for_status().json()
                    extra = http.get(server.url + "/get_server_info")
                    server.info = extra.json() if extra.status_code == 200 else {}
                except (httpx.HTTPError, ValueError) as exc:
                    self.pool.mark_dead(server, f"{type(exc).__name__}: {exc}")
                    continue
                server.tp_size = int(server.info.get("tp_size") or 1)
                versions.add(parse_version(info.get("weight_version")))
            if not self.pool.live:
                raise NoServerLeft(self.pool.describe_dead())
            if len(versions) > 1:
                log.warning("SGLang servers report different weight versions: %s", versions)
            self._version = max(versions)
            if self.router is not None:
                for server in self.pool.live:
                    _register_worker(http, self.router.url, server.url)

    # -- membership (servers joining and leaving a running job) -----------------------------

    def set_servers(self, urls: list[str], version: int) -> None:
        """Serve from exactly ``urls`` from now on, at weight ``version``. New URLs join
        rotation (the caller guarantees they serve ``version``), known ones are marked alive,
        and the others leave it: they get no new request, while the ones running finish."""
        wanted = [u.rstrip("/") for u in urls]
        for server in list(self.pool.servers):
            if server.url not in wanted:
                self.pool.remove(server.url)
        for url in wanted:
            self.add_server(url)
        self._version = int(version)

    def add_server(self, url: str) -> None:
        """Put the server at ``url`` in rotation; it must serve ``self.version`` already."""
        self.pool.add(Server(self._client(url)))

    def remove_server(self, url: str) -> None:
        """Take the server at ``url`` out of rotation; its running requests finish."""
        self.pool.remove(url)

    def servers(self) -> list[dict[str, Any]]:
        """Each server in the pool: url, alive (in rotation), in_flight (this client's
        requests running there) and its last error."""
        return [
            {"url": s.url, "alive": s.alive, "in_flight": s.in_flight, "error": s.error}
            for s in self.pool.servers
        ]

    def _client(self, url: str) -> ServerClient:
        return ServerClient(url, timeout_s=self.timeout_s, retries=self.retries)

    # -- InferenceBackend -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        """Between ``pause()`` and ``resume()``: a server joining now must be paused too."""
        return self._paused

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> GenerateOutput:
        """One completion. A request that a ``pause(mode=abort)`` of this backend cut short
        is re-sent after ``resume()`` as prompt + partial output, with ``max_new_tokens``
        reduced by what it already produced (as AReaL does); the answer is the concatenation,
        each token tagged with the version that sampled it. ``abort(request_id)`` returns
        what was sampled so far, with ``finish_reason`` ``"abort"``."""
        if sampling.n != 1:
            raise ValueError("generate() samples one completion; use generate_n for n > 1")
        rid = request_id or uuid.uuid4().hex
        key = affinity_key(request_id)
        parts: list[GenerateOutput] = []
        produced: list[int] = []
        self._generating.add(rid)
        try:
            while True:
                # A paused backend holds requests, new and interrupted ones, until resume().
                while self._paused and rid not in self._aborted:
                    await asyncio.sleep(PAUSE_POLL_S)
                if rid in self._aborted:
                    break
                left = sampling.max_new_tokens - len(produced)
                part = (
                    sampling if not parts else sampling.model_copy(update={"max_new_tokens": left})
                )
                pauses = self._pauses
                out = await self._generate_once([*input_ids, *produced], part, rid, key)
                parts.append(out)
                produced += out.output_ids
                interrupted = (
                    out.finish_reason == "abort"
                    and rid not in self._aborted
                    and (self._paused or self._pauses != pauses)
                )
                if not interrupted or len(produced) >= sampling.max_new_tokens:
                    break
        finally:
            self._generating.discard(rid)
            self._aborted.discard(rid)
        if not parts:  # aborted while held by a pause
            return GenerateOutput([], [], [], "abort", prompt_tokens=len(input_ids), request_id=rid)
        return _join(parts, prompt_tokens=len(input_ids), max_new_tokens=sampling.max_new_tokens)

    async def _generate_once(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, key: str | None
    ) -> GenerateOutput:
        """One ``/generate``, re-sent to another server if its server is gone."""
        body = generate_body(input_ids, sampling, rid)
        if self.lora_name is not None:
            body["lora_path"] = self.lora_name
        tried: set[str] = set()
        while True:
            server = self.pool.pick(key, exclude=tried)
            server.in_flight += 1
            self._where[rid] = server
            try:
                if self.router is not None:
                    headers = {ROUTING_HEADER: key} if key else None
                    response = await self.router.post(
                        "/generate", body, idempotent=False, headers=headers
                    )
                else:
                    response = await server.client.post("/generate", body, idempotent=False)
            except ServerUnavailable as exc:
                if self.router is not None:
                    raise
                if await server.client.healthy():
                    # The server is up: this request failed alone (it cannot be re-sent
                    # safely, the server may have started it); the server stays in rotation.
                    raise
                log.warning("taking %s out of rotation: %s; retrying elsewhere", server.url, exc)
                self.pool.mark_dead(server, str(exc))
                tried.add(server.url)
                continue
            finally:
                server.in_flight -= 1
                self._where.pop(rid, None)
            return parse_output(response.json(), prompt_len=len(input_ids), server=server.url)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._paused = True
        self._pauses += 1
        await self._fan_out(lambda s: s.client.post_json("/pause_generation", {"mode": mode}))

    async def resume(self) -> None:
        try:
            await self._fan_out(lambda s: s.client.post_json("/continue_generation", {}))
        finally:
            self._paused = False

    async def abort(self, request_id: str) -> None:
        if request_id in self._generating:
            self._aborted.add(request_id)  # not to be continued after a pause
        server = self._where.get(request_id)
        if server is not None:
            await server.client.post("/abort_request", {"rid": request_id})

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Load a safetensors directory (``/update_weights_from_disk``) on every server.
        The path must be readable by the servers. Named tensors travel by
        ``weights.method=broadcast`` instead (``SGLangBroadcastSync``)."""
        if isinstance(source, Mapping):
            raise TypeError(
                "the sglang backend loads weights from a directory (weights.method=disk) or "
                "over a process group (weights.method=broadcast), not from in-process tensors"
            )
        body = {
            "model_path": str(Path(source).resolve()),
            "weight_version": str(int(version)),
            "abort_all_requests": False,
            "flush_cache": True,
        }
        await self._fan_out(lambda s: s.client.post_json("/update_weights_from_disk", body))
        self._version = int(version)

    async def fan_out_post(self, route: str, body: dict[str, Any], *, strict: bool = True) -> None:
        """``POST route`` with ``body`` on every live server."""
        await self._fan_out(lambda s: s.client.post_json(route, body), strict=strict)

    async def set_version(self, version: int, servers: list[Server] | None = None) -> None:
        """Relabel the served weights as ``version`` on every server (or on ``servers``)."""
        body = {"new_version": str(int(version)), "abort_all_requests": False}
        if servers is None:
            await self._fan_out(lambda s: s.client.post_json("/update_weight_version", body))
        else:
            await asyncio.gather(
                *(s.client.post_json("/update_weight_version", body) for s in servers)
            )
        self._version = int(version)

    async def health(self) -> dict[str, Any]:
        """Probe every server; a server back up that serves ``version`` rejoins rotation."""

        async def probe(server: Server) -> str:
            if not await server.client.healthy():
                if server.alive:
                    self.pool.mark_dead(server, "GET /health failed")
                return server.error or "unhealthy"
            if not server.alive:
                info = (await server.client.get("/get_model_info", timeout_s=10)).json()
                served = parse_version(info.get("weight_version"))
                if served != self._version:
                    server.error = f"serves weight version {served}, not {self._version}"
                    return server.error
                self.pool.mark_alive(server)
            return "ok"

        states = await asyncio.gather(*(probe(s) for s in self.pool.servers))
        report = {s.url: state for s, state in zip(self.pool.servers, states, strict=True)}
        if not self.pool.live:
            raise NoServerLeft(self.pool.describe_dead())
        return {
            "status": "ok",
            "version": self._version,
            "servers": report,
            "paused": self._paused,
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for server in self.pool.servers:
            await server.client.aclose()
        if self.router is not None:
            await self.router.aclose()
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.stop)

    # -- the weight group (SGLang's NCCL refit; see weight_sync.py) -------------------------

    def rank_offsets(
        self, servers: list[Server] | None = None
    ) -> tuple[list[tuple[Server, int]], int]:
        """Each live server's (or each of ``servers``') first rank in the weight group (the
        trainer is rank 0), and the group's world size: ``1 + sum(tp_size)``."""
        offsets, rank = [], 1
        for server in self.pool.live if servers is None else servers:
            offsets.append((server, rank))
            rank += server.tp_size
        return offsets, rank

    async def init_weight_group(
        self,
        master_address: str,
        master_port: int,
        group_name: str,
        backend: str,
        servers: list[Server] | None = None,
    ) -> None:
        """``/init_weights_update_group`` on every live server (or on ``servers``); each
        joins at its offset. The trainer joins as rank 0 at the same time (these calls
        return once it has)."""
        offsets, world_size = self.rank_offsets(servers)

        async def init(server: Server, offset: int) -> Any:
            body = {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            return await server.client.post_json(
                "/init_weights_update_group", body, idempotent=False
            )

        await asyncio.gather(*(init(s, o) for s, o in offsets))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        servers: list[Server] | None = None,
    ) -> None:
        """One bucket's ``/update_weights_from_distributed`` on every live server (or on
        ``servers``, the group's members); the trainer broadcasts the tensors, in this
        order, while these calls are in flight."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        await asyncio.gather(
            *(
                s.client.post_json("/update_weights_from_distributed", body, idempotent=False)
                for s in (self.pool.live if servers is None else servers)
            )
        )

    async def update_weights_from_tensor(
        self,
        payload: str,
        *,
        load_format: str | None = "flattened_bucket",
        weight_version: int | None = None,
        timeout_s: float | None = None,
        flush_cache: bool = True,
        stage_for_version: int | None = None,
        staged_buckets: int = 0,
    ) -> None:
        """One bucket's ``/update_weights_from_tensor`` on every live server (the same
        payload for each of its TP ranks: colocated ranks open the same handle). The bucket
        must stay alive until this returns; with ``weight_version`` (the last bucket) the
        servers serve that version afterwards.

        ``stage_for_version`` and ``staged_buckets`` are the embedded engine's push without a
        pause (``backends/embedded/weight_stage.py``): buckets staged aside, then loaded all
        at once with the last one, which says how many were staged."""
        body: dict[str, Any] = {
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            body["weight_version"] = str(int(weight_version))
        if stage_for_version is not None:
            body["stage_for_version"] = str(int(stage_for_version))
        if staged_buckets:
            body["staged_buckets"] = staged_buckets

        async def push(server: Server) -> Any:
            one = {"serialized_named_tensors": [payload] * server.tp_size, **body}
            return await server.client.post_json(
                "/update_weights_from_tensor", one, idempotent=False, timeout_s=timeout_s
            )

        await self._fan_out(push)
        if weight_version is not None:
            self._version = int(weight_version)

    async def served_versions(self) -> dict[str, int]:
        """``GET /get_weight_version`` of every live server."""

        async def read(server: Server) -> tuple[str, int]:
            data = (await server.client.get("/get_weight_version", timeout_s=30)).json()
            return server.url, parse_version(data.get("weight_version"), default=-1)

        return dict(await self._fan_out(read))

    async def destroy_weight_group(
        self, group_name: str, servers: list[Server] | None = None
    ) -> None:
        """``/destroy_weights_update_group`` on every live server (or on ``servers``, live
        or not); a server that fails (it lost the group with its process) is left alone."""
        body = {"group_name": group_name}
        if servers is None:
            await self._fan_out(
                lambda s: s.client.post_json("/destroy_weights_update_group", body),
                strict=False,
            )
            return
        await asyncio.gather(
            *(s.client.post_json("/destroy_weights_update_group", body) for s in servers),
            return_exceptions=True,
        )

    def weight_sync_for(
        self, method: str, config: Config, *, trainer_rank: int = 0, **overrides: Any
    ) -> WeightSync | None:
        """The trainer side of ``method`` for these servers, where it differs from the
        generic one: ``broadcast`` drives SGLang's weight-group routes, ``cuda_ipc``
        ``/update_weights_from_tensor``; under ``train.lora`` every method moves the adapter
        (``lora.py``)."""
        if config.train.lora is not None:
            from areal_sdk.backends.sglang.lora import SGLangLoraSync

            return SGLangLoraSync.from_config(self, config, trainer_rank=trainer_rank, **overrides)
        if method == "broadcast":
            from areal_sdk.backends.sglang.weight_sync import SGLangBroadcastSync

            return SGLangBroadcastSync.from_config(
                self, config, trainer_rank=trainer_rank, **overrides
            )
        if method == "cuda_ipc":
            from areal_sdk.backends.sglang.tensor_sync import SGLangTensorSync

            return SGLangTensorSync.from_config(
                self, config, trainer_rank=trainer_rank, **overrides
            )
        return None

    # -- helpers ----------------------------------------------------------------------------

    async def _fan_out(
        self, call: Callable[[Server], Awaitable[T]], *, strict: bool = True
    ) -> list[T]:
        """``call`` on every live server at once. A server that cannot be reached leaves
        rotation (it would serve stale weights); any other failure is raised.

        With no server left, and a supervisor that restarts them (``rejoin_timeout_s``), it
        waits for one to rejoin and calls it: a restarted server comes back with the newest
        weights pushed before, so the call brings it up to date, and a lone server that dies
        during a push costs the run a restart, not its end."""
        deadline = time.monotonic() + self.rejoin_timeout_s
        out: list[T] = []
        called: set[int] = set()
        while True:
            servers = [s for s in self.pool.live if id(s) not in called]
            if not servers and not self.pool.live:
                if time.monotonic() >= deadline:
                    raise NoServerLeft(self.pool.describe_dead())
                await asyncio.sleep(REJOIN_POLL_S)
                continue
            if not servers:
                return out
            results = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
            for server, result in zip(servers, results, strict=True):
                called.add(id(server))
                if isinstance(result, ServerUnavailable):
                    log.warning("taking %s out of rotation: %s", server.url, result)
                    self.pool.mark_dead(server, str(result))
                elif isinstance(result, BaseException):
                    if strict:
                        raise result
                else:
                    out.append(result)
            if any(s.alive for s in servers) or self.rejoin_timeout_s <= 0:
                if not self.pool.live:
                    raise NoServerLeft(self.pool.describe_dead())
                return out
            # Every server called has gone: wait for a restarted one.
            called.clear()


def _join(
    parts: list[GenerateOutput], *, prompt_tokens: int, max_new_tokens: int
) -> GenerateOutput:
    """The answers of one request and its continuations as one completion."""
    last = parts[-1]
    if len(parts) == 1:
        return last
    ids = [t for p in parts for t in p.output_ids]
    finish = last.finish_reason
    if finish == "abort" and len(ids) >= max_new_tokens:
        finish = "length"  # cut by a pause exactly at the budget
    tops = [p.top_logprobs for p in parts]
    return GenerateOutput(
        output_ids=ids,
        logprobs=[x for p in parts for x in p.logprobs],
        versions=[v for p in parts for v in p.versions],
        finish_reason=finish,
        matched_stop=last.matched_stop,
        prompt_tokens=prompt_tokens,
        request_id=last.request_id,
        meta={**last.meta, "continuations": len(parts) - 1},
        top_logprobs=None if any(t is None for t in tops) else [x for t in tops for x in t],  # type: ignore[union-attr]
    )


def _register_worker(http: httpx.Client, router: str, worker: str) -> None:
    """Add ``worker`` to an sglang-router: ``POST /workers``, or the legacy
    ``POST /add_worker?url=`` of older releases. Already registered is fine."""
    response = http.post(router.rstrip("/") + "/workers", json={"url": worker})
    if response.status_code in (404, 405):
        response = http.post(router.rstrip("/") + "/add_worker", params={"url": worker})
    if response.status_code >= 400 and "already" not in response.text.lower():
        raise RuntimeError(
            f"sglang-router {router} refused worker {worker}: "
            f"{response.status_code} {response.text[:300]}"
        )


def _load_tokenizer(config: Config) -> Any:
    """The policy's tokenizer from a local directory (``model.tokenizer`` or
    ``model.path``); the gateway templates and decodes with it."""
    source = config.model.tokenizer or config.model.path
    if source is None and config.model.name is not None:
        from areal_sdk.models import resolve

        source = str(resolve(config.model.name))
    if source is None:
        return None
    from transformers import AutoTokenizer

    path = Path(source)
    if path.is_file():  # a .gguf file
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))
