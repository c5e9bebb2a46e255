"""``cuda_ipc``: trainer and engine on one GPU share bucket memory instead of copying it.

Each bucket is flattened into one CUDA buffer on the trainer's device and serialised with
``torch.multiprocessing``'s reductions (``ForkingPickler``): the payload is a CUDA IPC handle
of a few hundred bytes, not the weights (SGLang's ``/update_weights_from_tensor`` takes the
same ``MultiprocessingSerializer`` payload, base64-encoded; ``sglang_payload`` builds it).
The engine process opens the handle, copies the tensors into its own parameters and
releases the bucket; the trainer keeps at most ``in_flight`` buckets alive and frees each one
only after every engine rank released it.

The protocol (``channel.py``) and the serialisation are device-agnostic: with CPU tensors
the same reductions share memory through shared-memory file descriptors, which is how the
CPU tests exercise everything but the CUDA driver call.
"""

from __future__ import annotations

import base64
import io
from collections import deque
from typing import Any

import torch
from areal_sdk.backends.weight_sync.base import (
    NamedTensors,
    TensorMeta,
    flatten_bucket,
    unflatten_bucket,
)
from areal_sdk.backends.weight_sync.channel import ChannelReceiver, ChannelSync, Deadline

from areal_sdk.inference import InferenceBackend


def serialize_tensor(tensor: torch.Tensor) -> bytes:
    """A handle to ``tensor``'s memory (CUDA IPC, or CPU shared memory) another process can
    open while this one keeps ``tensor`` alive."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensor)
    return buf.getvalue()


def deserialize_tensor(payload: bytes) -> torch.Tensor:
    """Open a handle made by ``serialize_tensor`` (in another process)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    return ForkingPickler.loads(payload)


def sglang_payload(bucket: NamedTensors) -> str:
    """One TP rank's ``serialized_named_tensors`` entry for SGLang's
    ``/update_weights_from_tensor`` (``load_format`` null): base64 of the pickled pairs."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    buf = io.BytesIO()
    ForkingPickler(buf).dump([(name, t.detach()) for name, t in bucket])
    return base64.b64encode(buf.getvalue()).decode()


class CudaIpcSync(ChannelSync):
    """Trainer side: shares each bucket's memory with the engine ranks on the same GPU."""

    method = "cuda_ipc"

    def __init__(
        self,
        *,
        engine_ranks: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        device: torch.device | str = "cuda",
        in_flight: int = 2,
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
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self.device = torch.device(device)
        self.in_flight = in_flight
        self._pending: deque[tuple[int, int, torch.Tensor]] = deque()

    def _send_bucket(self, seq: int, index: int, bucket: NamedTensors, deadline: Deadline) -> int:
        assert self.channel is not None
        flat, metas = flatten_bucket(bucket, self.device)
        if flat.is_cuda:
            # The engine reads this memory from another process: no stream order there.
            torch.cuda.current_stream(flat.device).synchronize()
        self.channel.put(f"data/{seq}/{index}", serialize_tensor(flat))
        self.channel.put(
            f"sync/{seq}/{index}", {"tensors": [m.to_json() for m in metas], "size": flat.numel()}
        )
        self._pending.append((seq, index, flat))
        while len(self._pending) >= self.in_flight:
            self._wait_release(deadline)
        return flat.numel()

    def _wait_release(self, deadline: Deadline) -> None:
        assert self.channel is not None
        seq, index, _flat = self._pending[0]
        for rank in range(1, self.world_size):
            if not self.channel.wait(f"ack/{seq}/{rank}/{index}", deadline.left()):
                raise TimeoutError(
                    f"engine rank {rank} did not release bucket {index} within {self.timeout_s:g} s"
                )
            self.channel.delete(f"ack/{seq}/{rank}/{index}")
        self.channel.delete(f"data/{seq}/{index}")
        self._pending.popleft()  # the trainer may free the buffer now

    def _drain(self, seq: int, count: int, deadline: Deadline) -> None:
        while self._pending:
            self._wait_release(deadline)

    def _send(self, state: Any, version: int) -> tuple[int, int]:
        try:
            return super()._send(state, version)
        finally:
            self._pending.clear()
            if torch.cuda.is_available() and self.device.type == "cuda":
                torch.cuda.ipc_collect()


class CudaIpcReceiver(ChannelReceiver):
    """Engine side: opens the trainer's bucket handles and loads them."""

    method = "cuda_ipc"
    owns_buckets = False  # views of the trainer's memory, valid until released

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
        super().__init__(
            engine,
            master_addr=master_addr,
            port=port,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            apply_per_bucket=apply_per_bucket,
        )

    def _fetch(
        self, seq: int, index: int, meta: dict[str, Any], deadline: Deadline
    ) -> NamedTensors:
        assert self.channel is not None
        payload = self.channel.get_bytes(f"data/{seq}/{index}", deadline.left())
        if payload is None:
            raise TimeoutError(f"the handle of bucket {index} did not arrive")
        flat = deserialize_tensor(payload)
        if flat.numel() != int(meta["size"]):
            raise ValueError(f"bucket {index} has {flat.numel()} bytes, expected {meta['size']}")
        return unflatten_bucket(flat, [TensorMeta.from_json(row) for row in meta["tensors"]])

    def _release(self, seq: int, index: int) -> None:
        assert self.channel is not None
        self.channel.put(f"ack/{seq}/{self.rank}/{index}", {"released": True})
