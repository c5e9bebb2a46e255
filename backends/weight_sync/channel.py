"""The control channel and process group shared by the ``broadcast`` and ``cuda_ipc`` methods.

The trainer (rank 0) hosts a ``torch.distributed.TCPStore``; engine processes (ranks 1..R)
connect to it. Small control messages travel as store keys, each waited for with a
deadline, so a missing peer is an error after the timeout and never a hang:

- ``sync/<seq>``: a sync begins (the version);
- ``sync/<seq>/<i>``: bucket i's metadata (names, dtypes, shapes, byte offsets) or the end
  marker; sent before the bucket's bytes, like SGLang's ``/update_weights_from_distributed``
  request;
- ``ack/<seq>/<rank>`` (and ``ack/<seq>/<rank>/<i>`` per bucket for CUDA IPC): the engine's
  answer, with the version it now serves or the error it hit.

``ChannelSync`` (trainer) and ``ChannelReceiver`` (engine) run this protocol; the methods
only say how a bucket's bytes travel. The tensor bytes go through a process group of its own (``ProcessGroupGloo`` or
``ProcessGroupNCCL`` built directly on the store), so it never touches the trainer's default
group (DeepSpeed's) and works in processes that have none.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from areal_sdk.backends.weight_sync.base import (
    NamedTensors,
    WeightSync,
    WeightSyncError,
    cast_bucket,
)

from areal_sdk.inference import InferenceBackend

log = logging.getLogger(__name__)

# How often an idle receiver re-checks for a new sync (and for close()).
POLL_S = 0.5


class Deadline:
    """Seconds left until a fixed point in time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.end


class ControlChannel:
    """Key/value control messages over a TCPStore hosted by the trainer."""

    def __init__(
        self, addr: str, port: int, world_size: int, *, is_master: bool, timeout_s: float
    ) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        try:
            self.store = dist.TCPStore(
                addr,
                port,
                world_size,
                is_master=is_master,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:
            role = "host" if is_master else "reach"
            raise WeightSyncError(
                f"could not {role} the weight-sync store at {addr}:{port}: {exc}"
            ) from exc
        self.port = int(self.store.port)

    @property
    def where(self) -> str:
        return f"{self.addr}:{self.port}"

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (bytes as is, anything else as JSON) under ``key``."""
        data = value if isinstance(value, bytes) else json.dumps(value).encode()
        self.store.set(key, data)

    def wait(self, key: str, seconds: float) -> bool:
        """True once ``key`` exists; False if it did not appear within ``seconds``.

        Polls with ``check`` (backing off from 1 ms to 50 ms) rather than ``store.wait``,
        whose timeouts log a c10d warning each time an idle receiver looks for work.
        Raises if the store itself is unreachable (its host died).
        """
        deadline = Deadline(seconds)
        pause = 0.001
        while True:
            if self.store.check([key]):
                return True
            if deadline.expired:
                return False
            time.sleep(min(pause, deadline.left()))
            pause = min(pause * 2, 0.05)

    def get_bytes(self, key: str, seconds: float) -> bytes | None:
        if not self.wait(key, seconds):
            return None
        return bytes(self.store.get(key))

    def get_json(self, key: str, seconds: float) -> Any:
        data = self.get_bytes(key, seconds)
        return None if data is None else json.loads(data)

    def delete(self, *keys: str) -> None:
        for key in keys:
            # Already gone, or the store went away with the other side: nothing to free.
            with contextlib.suppress(Exception):
                self.store.delete_key(key)


def make_group(
    backend: str, channel: ControlChannel, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """A process group of ``world_size`` ranks over ``channel``'s store, apart from the
    default group. Blocks until every rank has joined (gloo) or its first collective (NCCL)."""
    store = dist.PrefixStore("weights/pg", channel.store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"unknown process-group backend {backend!r} (gloo or nccl)")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from rank 0 in ``group`` and wait, at most ``timeout_s``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    work = group.broadcast([tensor], opts)
    work.wait(timedelta(seconds=timeout_s))
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` -> nccl for CUDA, gloo otherwise."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ValueError("weights.group_backend=nccl needs the trainer on CUDA")
    return name


class ChannelSync(WeightSync):
    """Trainer side of a method that talks through a ``ControlChannel`` (rank 0 of R + 1).

    Subclasses say how engines join (``_join``) and how one bucket's bytes travel
    (``_send_bucket``); this class runs the sync protocol and collects acknowledgements.
    """

    def __init__(
        self,
        *,
        engine_ranks: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        trainer_rank: int = 0,
    ) -> None:
        super().__init__(timeout_s=timeout_s, dtype=dtype, trainer_rank=trainer_rank)
        if engine_ranks < 1:
            raise ValueError(f"engine_ranks must be at least 1, got {engine_ranks}")
        self.engine_ranks = engine_ranks
        self.world_size = 1 + engine_ranks
        self.master_addr = master_addr
        self.master_port = master_port
        self.channel: ControlChannel | None = None
        self._joined = False
        self._seq = 0

    @property
    def port(self) -> int:
        """The store's port (the one picked when ``master_port`` was 0)."""
        return self.open_store()

    @property
    def _peers(self) -> str:
        where = self.channel.where if self.channel else f"{self.master_addr}:{self.master_port}"
        ranks = "1" if self.engine_ranks == 1 else f"1..{self.engine_ranks}"
        return f"engine rank {ranks} (store {where})"

    def open_store(self) -> int:
        """Host the control store now, so engines can be told its port; returns the port."""
        if self.channel is None:
            self.channel = ControlChannel(
                self.master_addr,
                self.master_port,
                self.world_size,
                is_master=True,
                timeout_s=self.timeout_s,
            )
        return self.channel.port

    async def connect(self) -> None:
        """Host the store and wait, at most ``timeout_s``, for every engine rank to join."""
        if self.trainer_rank != 0 or self._joined:
            return
        self.open_store()
        try:
            await asyncio.to_thread(self._join)
        except Exception as exc:
            raise WeightSyncError(
                f"{self.method} weight sync: {self._peers} did not join within "
                f"{self.timeout_s:g} s: {exc}"
            ) from exc
        self._joined = True

    def _join(self) -> None:
        """Wait until every engine rank has said hello."""
        assert self.channel is not None
        deadline = Deadline(self.timeout_s)
        for rank in range(1, self.world_size):
            if not self.channel.wait(f"hello/{rank}", deadline.left()):
                raise TimeoutError(f"engine rank {rank} never connected")

    @abc.abstractmethod
    def _send_bucket(self, seq: int, index: int, bucket: NamedTensors, deadline: Deadline) -> int:
        """Publish bucket ``index``'s metadata and move its bytes; return the bytes moved."""

    def _drain(self, seq: int, count: int, deadline: Deadline) -> None:
        """Called after the last bucket (CUDA IPC waits for its last buckets' releases)."""

    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        await self.connect()
        return await asyncio.to_thread(self._send, state, version)

    def _send(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        assert self.channel is not None
        channel, deadline = self.channel, Deadline(self.timeout_s)
        self._seq += 1
        seq = self._seq
        channel.put(f"sync/{seq}", {"version": version})
        tensors = nbytes = 0
        i = 0  # the next bucket's key; the end marker takes the one after the last bucket
        try:
            for bucket in state:
                bucket = cast_bucket(bucket, self.dtype)
                if not bucket:
                    continue
                nbytes += self._send_bucket(seq, i, bucket, deadline)
                tensors += len(bucket)
                i += 1
            self._drain(seq, i, deadline)
        except Exception as exc:
            channel.put(f"sync/{seq}/{i}", {"abort": f"{type(exc).__name__}: {exc}"})
            raise self._fail(version, self._peers, f"bucket {i} failed: {exc}") from exc
        channel.put(f"sync/{seq}/{i}", {"end": True, "tensors": tensors})
        self._collect_acks(seq, version, deadline)
        channel.delete(f"sync/{seq}", *(f"sync/{seq}/{k}" for k in range(i + 1)))
        return tensors, nbytes

    def _collect_acks(self, seq: int, version: int, deadline: Deadline) -> None:
        assert self.channel is not None
        for rank in range(1, self.world_size):
            ack = self.channel.get_json(f"ack/{seq}/{rank}", deadline.left())
            peer = f"engine rank {rank} (store {self.channel.where})"
            if ack is None:
                raise self._fail(version, peer, f"no acknowledgement within {self.timeout_s:g} s")
            if ack.get("error"):
                raise self._fail(version, peer, f"the engine failed: {ack['error']}")
            if ack.get("version") != version:
                raise self._fail(version, peer, f"the engine serves version {ack.get('version')}")
            self.channel.delete(f"ack/{seq}/{rank}")

    async def close(self) -> None:
        self.channel = None
        self._joined = False


class ChannelReceiver:
    """Engine side of a ``ChannelSync`` method: waits for syncs, loads them, acknowledges.

    Subclasses say how to join (``_join``) and how to get one bucket's tensors
    (``_fetch``); ``owns_buckets`` says whether those tensors stay valid after ``_release``
    (received copies do; CUDA IPC views of the trainer's memory do not, and are cloned when
    they must outlive it).
    """

    method = "channel"
    owns_buckets = True

    def __init__(
        self,
        engine: InferenceBackend,
        *,
        master_addr: str = "127.0.0.1",
        port: int,
        rank: int = 1,
        world_size: int = 2,
        timeout_s: float = 120.0,
        apply_per_bucket: bool = False,
    ) -> None:
        if not 1 <= rank < world_size:
            raise ValueError(f"engine rank must be in 1..{world_size - 1}, got {rank}")
        self.engine = engine
        self.master_addr = master_addr
        self.port = port
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.apply_per_bucket = apply_per_bucket
        self.channel: ControlChannel | None = None
        self.received: list[int] = []  # versions loaded, in order
        self._joined = False
        self._seq = 0
        self._closed = False

    @property
    def _peer(self) -> str:
        return f"trainer at {self.master_addr}:{self.port}"

    async def connect(self) -> None:
        """Reach the trainer's store and join (waits at most ``timeout_s``)."""
        if self._joined:
            return

        def join() -> None:
            self.channel = ControlChannel(
                self.master_addr,
                self.port,
                self.world_size,
                is_master=False,
                timeout_s=self.timeout_s,
            )
            self.channel.put(f"hello/{self.rank}", {"rank": self.rank})
            self._join()

        try:
            await asyncio.to_thread(join)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(
                f"{self.method} engine rank {self.rank} could not join the {self._peer} "
                f"within {self.timeout_s:g} s: {exc}"
            ) from exc
        self._joined = True

    def _join(self) -> None:
        """Anything beyond the hello (joining a process group)."""

    @abc.abstractmethod
    def _fetch(
        self, seq: int, index: int, meta: dict[str, Any], deadline: Deadline
    ) -> NamedTensors:
        """Bucket ``index``'s tensors (blocking; runs in a worker thread)."""

    def _release(self, seq: int, index: int) -> None:
        """The engine is done with bucket ``index`` (CUDA IPC tells the trainer)."""

    async def serve(self) -> None:
        """Receive and load versions until ``close()``; raises ``WeightSyncError`` if the
        trainer goes away or a version fails to load."""
        await self.connect()
        while not self._closed:
            await self.receive_one(idle_timeout_s=None)

    async def receive_one(self, idle_timeout_s: float | None = None) -> int | None:
        """Wait for the next sync (forever, or ``idle_timeout_s``), load it, acknowledge it.
        Returns the version loaded, or ``None`` if none began in time (or on close)."""
        await self.connect()
        assert self.channel is not None
        seq = self._seq + 1
        waited = Deadline(idle_timeout_s if idle_timeout_s is not None else float("inf"))
        header = None
        while header is None and not self._closed and not waited.expired:
            step = min(POLL_S, waited.left())
            try:
                header = await asyncio.to_thread(self.channel.get_json, f"sync/{seq}", step)
            except Exception as exc:  # the store itself is gone: the trainer died
                raise WeightSyncError(
                    f"{self.method} engine rank {self.rank} lost the {self._peer}: {exc}"
                ) from exc
        if header is None:
            return None
        self._seq = seq
        version = int(header["version"])
        error = None
        try:
            await self._receive(seq, version)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("%s weight sync of version %d failed: %s", self.method, version, error)
        try:
            self.channel.put(
                f"ack/{seq}/{self.rank}", {"version": self.engine.version, "error": error}
            )
        except Exception as exc:
            raise WeightSyncError(
                f"{self.method} engine rank {self.rank} lost the {self._peer}: {exc}"
            ) from exc
        if error is not None:
            raise WeightSyncError(
                f"{self.method} engine rank {self.rank}: version {version} failed: {error}"
            )
        self.received.append(version)
        return version

    async def _receive(self, seq: int, version: int) -> None:
        assert self.channel is not None
        deadline = Deadline(self.timeout_s)
        collected: dict[str, torch.Tensor] = {}
        previous = self.engine.version
        failure: Exception | None = None
        i = 0
        while True:
            key = f"sync/{seq}/{i}"
            meta = await asyncio.to_thread(self.channel.get_json, key, deadline.left())
            if meta is None:
                raise WeightSyncError(
                    f"bucket {i} of version {version} did not come from the {self._peer} "
                    f"within {self.timeout_s:g} s"
                )
            if "abort" in meta:
                raise WeightSyncError(f"the {self._peer} aborted the sync: {meta['abort']}")
            if meta.get("end"):
                break
            bucket = await asyncio.to_thread(self._fetch, seq, i, meta, deadline)
            if failure is None:  # after a failure keep receiving, so the trainer is not stuck
                try:
                    if self.apply_per_bucket:
                        await self.engine.update_weights(dict(bucket), previous)
                    elif self.owns_buckets:
                        collected.update(bucket)
                    else:
                        collected.update((n, t.clone()) for n, t in bucket)
                except Exception as exc:
                    failure = exc
            del bucket
            self._release(seq, i)
            i += 1
        if failure is not None:
            raise failure
        if self.apply_per_bucket:
            # Every weight is new now; relabel them as the new version in one step.
            setter = getattr(self.engine, "set_version", None)
            if setter is None:
                raise WeightSyncError(
                    f"{type(self.engine).__name__} has no set_version(); use apply_per_bucket=False"
                )
            await setter(version)
        else:
            await self.engine.update_weights(collected, version)

    async def close(self) -> None:
        self._closed = True
