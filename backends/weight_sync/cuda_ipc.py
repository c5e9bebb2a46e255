"""``cuda_ipc``: trainer and engine on one GPU share bucket memory instead of copying it.

Each bucket is flattened into one CUDA buffer on the trainer's device and serialised with
``torch.multiprocessing``'s reductions (``ForkingPickler``): the payload is a CUDA IPC handle
of a few hundred bytes, not the weights (SGLang's ``/update_weights_from_tensor`` takes the
same ``MultiprocessingSerializer`` payload, base64-encoded: ``sglang_payload`` builds it,
``flattened_bucket`` lays out its ``flattened_bucket`` format, ``read_sglang_payload`` reads it
on the server side).
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
import pickle
from collections import deque
from types import SimpleNamespace
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


def sglang_payload(obj: NamedTensors | dict[str, Any]) -> str:
    """One TP rank's ``serialized_named_tensors`` entry for SGLang's
    ``/update_weights_from_tensor``: base64 of the pickled ``(name, tensor)`` pairs
    (``load_format`` null or ``direct``) or of a ``{"flattened_tensor", "metadata"}`` bucket
    (``flattened_bucket``)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    if isinstance(obj, list):
        obj = [(name, t.detach()) for name, t in obj]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def flattened_bucket(
    bucket: NamedTensors, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """SGLang's ``flattened_bucket``: every tensor of ``bucket`` cast to ``dtype`` into one
    contiguous 1-D tensor on ``device``, and per tensor its ``name``, ``shape``, ``dtype``,
    ``start_idx``, ``end_idx`` and ``numel`` (element indices). The metadata are
    ``SimpleNamespace`` objects, which any Python unpickles into something SGLang reads by
    attribute."""
    metadata = []
    start = 0
    for name, t in bucket:
        numel = t.numel()
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=torch.Size(t.shape),
                dtype=dtype,
                start_idx=start,
                end_idx=start + numel,
                numel=numel,
            )
        )
        start += numel
    flat = torch.empty(start, dtype=dtype, device=device)
    for meta, (_, t) in zip(metadata, bucket, strict=True):
        flat[meta.start_idx : meta.end_idx].copy_(t.detach().reshape(-1), non_blocking=True)
    return {"flattened_tensor": flat, "metadata": metadata}


class PayloadError(ValueError):
    """An ``/update_weights_from_tensor`` payload that cannot be read as named tensors."""


# What a payload may construct: torch's tensor rebuilders and the few plain types around
# them. A payload naming anything else is refused before it runs; the route still trusts
# its caller as SGLang's does (serve it on loopback).
_ALLOWED: dict[str, Any] = {
    "torch.multiprocessing.reductions": lambda n: n.startswith("rebuild_"),
    "torch._utils": lambda n: n.startswith("_rebuild_"),
    "torch.storage": {"UntypedStorage", "TypedStorage"}.__contains__,
    "torch.nn.parameter": {"Parameter"}.__contains__,
    "torch": lambda n: (
        n in {"Tensor", "Size", "device"} or isinstance(getattr(torch, n, None), torch.dtype)
    ),
    "multiprocessing.resource_sharer": {"DupFd"}.__contains__,
    "collections": {"OrderedDict"}.__contains__,
    "types": {"SimpleNamespace"}.__contains__,
}


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("sglang.") and name == "FlattenedTensorMetadata":
            return SimpleNamespace  # SGLang's metadata dataclass, read by attribute
        allowed = _ALLOWED.get(module)
        if allowed is None or not allowed(name):
            raise PayloadError(f"the payload references {module}.{name}, which is not allowed")
        return super().find_class(module, name)


def read_sglang_payload(text: str, load_format: str | None) -> NamedTensors:
    """The named tensors of one ``serialized_named_tensors`` entry (see ``sglang_payload``).

    Raises ``PayloadError`` for bad base64, a pickle that does not load, or contents of the
    wrong shape. Tensors of a flattened bucket are views of its buffer (cast where the
    metadata's dtype differs)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as exc:
        raise PayloadError(f"the payload is not valid base64: {exc}") from None
    import torch.multiprocessing  # noqa: F401

    try:
        obj = _PayloadUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as exc:
        raise PayloadError(f"the payload does not unpickle: {type(exc).__name__}: {exc}") from None
    if load_format in (None, "direct"):
        return _pairs(obj)
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    raise PayloadError(
        f"load_format {load_format!r} is not supported (null, direct, flattened_bucket)"
    )


def _pairs(obj: Any) -> NamedTensors:
    if not isinstance(obj, (list, tuple)) or not obj:
        raise PayloadError("the payload must be a non-empty list of (name, tensor) pairs")
    out = []
    for item in obj:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise PayloadError(
                f"every entry must be a (name, tensor) pair, got {type(item).__name__}"
            )
        out.append((item[0], item[1]))
    return out


def _field(meta: Any, key: str) -> Any:
    value = meta.get(key) if isinstance(meta, dict) else getattr(meta, key, None)
    if value is None:
        raise PayloadError(f"bucket metadata entry lacks {key!r}")
    return value


def _unflatten(obj: Any) -> NamedTensors:
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
        raise PayloadError(
            'a flattened bucket must be {"flattened_tensor": ..., "metadata": [...]}'
        )
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise PayloadError("flattened_tensor must be a 1-D tensor")
    if not isinstance(metadata, (list, tuple)) or not metadata:
        raise PayloadError("the bucket's metadata must be a non-empty list")
    out = []
    for meta in metadata:
        name, shape, dtype = _field(meta, "name"), _field(meta, "shape"), _field(meta, "dtype")
        start, end = int(_field(meta, "start_idx")), int(_field(meta, "end_idx"))
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise PayloadError(f"bucket metadata entry {name!r} has a bad name or dtype")
        shape = torch.Size([int(s) for s in shape])
        if not 0 <= start <= end <= flat.numel() or end - start != shape.numel():
            raise PayloadError(
                f"{name!r}: elements {start}:{end} of a {flat.numel()}-element bucket do not "
                f"hold shape {tuple(shape)}"
            )
        piece = flat[start:end].view(shape)
        out.append((name, piece if piece.dtype == dtype else piece.to(dtype)))
    return out


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
