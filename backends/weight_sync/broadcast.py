"""``broadcast``: weights over a torch.distributed group, trainer rank 0 to engine ranks.

The trainer side (``BroadcastSync``) and the engine side (``BroadcastReceiver``, hosted by
the engine process) meet at the trainer's control store (``channel.py``): SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed`` in spirit, with gloo on
CPU and NCCL on GPU. Per bucket the trainer publishes the metadata (names, dtypes, shapes,
offsets), then broadcasts the bucket as one flat byte buffer; the receiver unflattens it
into views and, at the end, calls ``engine.update_weights(tensors, version)`` once (or per
bucket with ``apply_per_bucket``, keeping the old version until the last one, which bounds
engine memory to one bucket). Each engine rank then acknowledges the version it serves;
the push returns when all agree.

Failure: a receiver that died makes the broadcast fail at once (connection reset); one that
hangs makes it fail after ``timeout_s``; either way the error names the engine ranks and the
store address. A trainer that died makes the receiver's wait fail the same way.

>>> sync = BroadcastSync(engine_ranks=1, timeout_s=60)                  # trainer process
>>> port = sync.open_store()            # tell the engines this port
>>> receiver = BroadcastReceiver(engine, port=port, rank=1, world_size=2)  # engine process
>>> await asyncio.gather(sync.connect(), receiver.connect())
>>> serving = asyncio.create_task(receiver.serve())                    # engine process
>>> await sync.push(backend.state_for_sync(256 << 20), version=3)      # trainer process
"""

from __future__ import annotations

from typing import Any

import torch
from areal_sdk.backends.weight_sync.base import (
    NamedTensors,
    TensorMeta,
    flatten_bucket,
    unflatten_bucket,
)
from areal_sdk.backends.weight_sync.channel import (
    ChannelReceiver,
    ChannelSync,
    Deadline,
    broadcast,
    make_group,
    resolve_backend,
)

from areal_sdk.inference import InferenceBackend


class BroadcastSync(ChannelSync):
    """Trainer side: rank 0 of the weight group, hosting its control store."""

    method = "broadcast"

    def __init__(
        self,
        *,
        engine_ranks: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "auto",
        device: torch.device | str = "cpu",
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        trainer_rank: int = 0,
    ) -> None:
        super().__init__(
            engine_ranks=engine_ranks,
            master_addr=master_addr,
            master_port=master_port,
            timeout_s=timeout_s,
            dtype=dtype,
            trainer_rank=trainer_rank,
        )
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.group: torch.distributed.ProcessGroup | None = None

    def _join(self) -> None:
        super()._join()
        assert self.channel is not None
        self.group = make_group(self.backend, self.channel, 0, self.world_size, self.timeout_s)

    def _send_bucket(self, seq: int, index: int, bucket: NamedTensors, deadline: Deadline) -> int:
        assert self.channel is not None and self.group is not None
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        flat, metas = flatten_bucket(bucket, device)
        meta = {"tensors": [m.to_json() for m in metas], "size": flat.numel()}
        self.channel.put(f"sync/{seq}/{index}", meta)
        broadcast(self.group, flat, max(deadline.left(), 0.001))
        return flat.numel()

    async def close(self) -> None:
        self.group = None
        await super().close()


class BroadcastReceiver(ChannelReceiver):
    """Engine side: joins the trainer's weight group and loads every version it receives."""

    method = "broadcast"
    owns_buckets = True  # each bucket lands in a fresh buffer of ours

    def __init__(
        self,
        engine: InferenceBackend,
        *,
        master_addr: str = "127.0.0.1",
        port: int,
        rank: int = 1,
        world_size: int = 2,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        timeout_s: float = 120.0,
        apply_per_bucket: bool = False,
    ) -> None:
        super().__init__(
            engine,
            master_addr=master_addr,
            port=port,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            apply_per_bucket=apply_per_bucket,
        )
        self.backend = backend
        self.device = torch.device(device)
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("an NCCL receiver needs a CUDA device")
        self.group: torch.distributed.ProcessGroup | None = None

    def _join(self) -> None:
        assert self.channel is not None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.group = make_group(
            self.backend, self.channel, self.rank, self.world_size, self.timeout_s
        )

    def _fetch(
        self, seq: int, index: int, meta: dict[str, Any], deadline: Deadline
    ) -> NamedTensors:
        assert self.group is not None
        metas = [TensorMeta.from_json(row) for row in meta["tensors"]]
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        flat = torch.empty(int(meta["size"]), dtype=torch.uint8, device=device)
        broadcast(self.group, flat, max(deadline.left(), 0.001))
        return unflatten_bucket(flat, metas)
