"""``broadcast`` into SGLang servers: the trainer's side of SGLang's NCCL weight refit.

``make_weight_sync("broadcast", config, engine=<SGLangBackend>)`` returns this. The first
push opens the weight group: every server gets ``/init_weights_update_group`` (its
``rank_offset`` is 1 + the TP ranks of the servers before it) while the trainer joins as rank
0 (``process_group.py``). Then, per bucket of ``TrainBackend.state_for_sync``, every server
gets ``/update_weights_from_distributed`` with the bucket's names, dtypes and shapes while
the trainer broadcasts those tensors in that order (SGLang's default ``load_format``, one
broadcast per tensor, as AReaL does). Last, ``/update_weight_version`` makes every server
report ``version``. gloo on CPU, NCCL when the trainer is on CUDA.

A bucket a server refuses, or a broadcast nobody receives within ``timeout_s``, fails the
push with ``WeightSyncError`` naming the servers; the group is then torn down and the next
push builds a new one. When a member stopped answering ``/health`` by then (it died during
the push), the error is a ``PeerLostError``: the member is out of rotation and the trainer
pushes again to the servers left.

The group holds the servers that were live when it opened. Before each push a member that
no longer answers ``/health`` leaves rotation, and when the live servers differ from the
members (one died, restarted, joined or left) the group is built again over the live ones.
A server that joins during a push gets none of it and keeps its version; the fleet that
added it brings it up to date (``EngineFleet`` loads the latest weights into a server that
serves an older version).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from areal_sdk.backends.sglang.backend import REJOIN_POLL_S
from areal_sdk.backends.sglang.process_group import (
    broadcast_from_trainer,
    destroy_weight_group,
    init_weight_group,
)
from areal_sdk.backends.weight_sync.base import (
    NamedTensors,
    PeerLostError,
    WeightSync,
    cast_bucket,
    check_engine_version,
    sync_dtype,
)
from areal_sdk.backends.weight_sync.channel import resolve_backend

if TYPE_CHECKING:
    from areal_sdk.backends.sglang.backend import SGLangBackend
    from areal_sdk.backends.sglang.pool import Server

    from areal_sdk.config import Config

GROUP_NAME = "weight_update_group"
# How long a member of the weight group may take to answer GET /health before a push.
PROBE_TIMEOUT_S = 5.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ServerWeightSync(WeightSync):
    """The trainer side of a method that drives the weight routes of ``engine``'s servers."""

    engine: SGLangBackend

    @staticmethod
    def config_args(config: Config, trainer_rank: int) -> dict[str, Any]:
        """The constructor arguments every such sync takes from the config."""
        return {
            "device": config.train.device,
            "timeout_s": config.weights.timeout_s,
            "dtype": sync_dtype(config.weights.dtype),
            "trainer_rank": trainer_rank,
        }

    @property
    def _peers(self) -> str:
        return "SGLang servers " + ", ".join(s.url for s in self.engine.pool.live)


class SGLangBroadcastSync(ServerWeightSync):
    """Trainer rank 0 of SGLang's weight-update group."""

    method = "broadcast"

    def __init__(
        self,
        engine: SGLangBackend,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "auto",
        device: torch.device | str = "cpu",
        group_name: str = GROUP_NAME,
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        trainer_rank: int = 0,
    ) -> None:
        super().__init__(timeout_s=timeout_s, dtype=dtype, trainer_rank=trainer_rank)
        self.engine = engine
        self.master_addr = master_addr
        self.master_port = master_port
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.group_name = group_name
        self.group: torch.distributed.ProcessGroup | None = None
        self.members: list[Server] = []  # the servers in the group, in rank order

    @classmethod
    def from_config(
        cls, engine: SGLangBackend, config: Config, *, trainer_rank: int = 0, **overrides: Any
    ) -> SGLangBroadcastSync:
        w = config.weights
        args: dict[str, Any] = {
            **cls.config_args(config, trainer_rank),
            "master_addr": w.master_addr,
            "master_port": w.master_port,
            "backend": w.group_backend,
            **overrides,
        }
        return cls(engine, **args)

    async def connect(self, version: int = 0) -> None:
        """Open the weight group with every live server, again when they changed."""
        if self.group is not None:
            await self._drop_silent_members()
            live = self.engine.pool.live
            if len(live) == len(self.members) and all(
                a is b for a, b in zip(live, self.members, strict=True)
            ):
                return
            await self._teardown()
        members = await self._live_servers(version)
        port = self.master_port or _free_port(self.master_addr)
        _, world_size = self.engine.rank_offsets(members)
        results = await asyncio.gather(
            asyncio.to_thread(
                init_weight_group,
                self.backend,
                self.master_addr,
                port,
                0,
                world_size,
                self.group_name,
                self.timeout_s,
            ),
            self.engine.init_weight_group(
                self.master_addr, port, self.group_name, self.backend, members
            ),
            return_exceptions=True,
        )
        group, init = results
        if isinstance(init, BaseException) or isinstance(group, BaseException):
            if not isinstance(group, BaseException):
                destroy_weight_group(group)
            cause = init if isinstance(init, BaseException) else group
            raise self._fail(
                version,
                self._peers,
                f"opening the weight group at {self.master_addr}:{port} failed: {cause}",
            ) from cause
        self.group, self.members = group, members

    async def _live_servers(self, version: int) -> list[Server]:
        """The servers in rotation; with none, wait for a restarted one as long as the
        backend waits for one (``rejoin_timeout_s``)."""
        deadline = time.monotonic() + self.engine.rejoin_timeout_s
        while not self.engine.pool.live:
            if time.monotonic() >= deadline:
                raise self._fail(version, "the weight group", self.engine.pool.describe_dead())
            await asyncio.sleep(REJOIN_POLL_S)
        return list(self.engine.pool.live)

    async def _drop_silent_members(self) -> None:
        """Take members that do not answer ``/health`` out of rotation: a broadcast to a
        dead rank would fail the push, while the fleet restarts them and the next group
        takes them back."""

        async def probe(server: Server) -> None:
            if server.alive and not await server.client.healthy(timeout_s=PROBE_TIMEOUT_S):
                self.engine.pool.mark_dead(server, "left the weight group: GET /health failed")

        await asyncio.gather(*(probe(s) for s in self.members))

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        assert self.group is not None
        for t in tensors:
            broadcast_from_trainer(self.group, t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        await self.connect(version)
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        buckets = iter(state)
        tensors = nbytes = index = 0
        try:
            while True:
                # Gathering a bucket may block (ZeRO-3): keep it off the event loop.
                bucket = await asyncio.to_thread(next, buckets, None)
                if bucket is None:
                    break
                bucket = cast_bucket(bucket, self.dtype)
                if not bucket:
                    continue
                send = [t.detach().to(device).contiguous() for _, t in bucket]
                request = self.engine.update_weights_from_distributed(
                    [n for n, _ in bucket],
                    [dtype_name(t.dtype) for t in send],
                    [list(t.shape) for t in send],
                    self.group_name,
                    self.members,
                )
                results = await asyncio.wait_for(
                    asyncio.gather(
                        request, asyncio.to_thread(self._broadcast, send), return_exceptions=True
                    ),
                    self.timeout_s,
                )
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                tensors += len(send)
                nbytes += sum(t.numel() * t.element_size() for t in send)
                index += 1
            await self.engine.set_version(version, self.members)
        except Exception as exc:
            # A member that died mid-push is why a broadcast fails: take it out of rotation,
            # so that a second push opens the group over the servers left.
            await self._drop_silent_members()
            lost = [s.url for s in self.members if not s.alive]
            await self._teardown()
            error = self._fail(version, self._peers, f"bucket {index} failed: {exc}")
            if lost:
                raise PeerLostError(f"{error} ({', '.join(lost)} left the group)", lost) from exc
            raise error from exc
        check_engine_version(self, self.engine, version, self._peers)
        return tensors, nbytes

    async def _teardown(self) -> None:
        group, members = self.group, self.members
        self.group, self.members = None, []
        if group is not None:
            try:
                # Every member, in rotation or not: one that still holds the group would
                # refuse to join the next one under the same name.
                await self.engine.destroy_weight_group(self.group_name, members)
            finally:
                destroy_weight_group(group)

    async def close(self) -> None:
        await self._teardown()
