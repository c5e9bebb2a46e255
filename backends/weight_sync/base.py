"""What every weight-sync method shares: the interface, the error, dtype casts, flat buckets.

A ``WeightSync`` moves the trainer's weights (``TrainBackend.state_for_sync`` buckets) into
the inference engine as one new version. ``await sync.push(state, version)`` returns when
the engine serves ``version``, and raises ``WeightSyncError`` (naming the peer and the
version) when it cannot, at the latest after ``timeout_s``: never a silent hang.

Multi-rank trainers call ``push`` on every rank, since gathering a ZeRO-3 bucket is a
collective; only ``trainer_rank`` 0 sends, the other ranks just walk the buckets.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

NamedTensors = list[tuple[str, torch.Tensor]]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Each tensor of a flat bucket starts at a multiple of this, so views of any dtype line up.
ALIGN = 16


class WeightSyncError(RuntimeError):
    """A sync that failed or timed out; the message names the method, version and peer."""


class PeerLostError(WeightSyncError):
    """A sync that failed because engine servers left during it (``lost`` names them). The
    servers still in rotation never got the whole version, and a fresh push reaches them:
    the trainer pushes once more instead of ending the run."""

    def __init__(self, message: str, lost: list[str]) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True)
class SyncResult:
    """What one push moved."""

    method: str
    version: int
    tensors: int
    bytes: int
    seconds: float


def sync_dtype(name: str) -> torch.dtype | None:
    """``weights.dtype`` as a torch dtype; ``None`` for ``auto`` (keep the trainer's)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown weights.dtype {name!r}")
    return DTYPES[name]


def cast_bucket(bucket: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
    """Floating-point tensors cast to ``dtype`` (others untouched); no-op for ``None``."""
    if dtype is None:
        return bucket
    return [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in bucket]


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits in a flat bucket (the metadata message sent before the bytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, row: list[object]) -> TensorMeta:
        name, dtype, shape, offset, nbytes = row
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))  # type: ignore[union-attr, call-overload]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_layout(bucket: NamedTensors) -> tuple[list[TensorMeta], int]:
    """Offsets of each tensor in the flat byte buffer, and the buffer's size."""
    metas = []
    offset = 0
    for name, t in bucket:
        if t.dtype not in DTYPE_NAMES:
            raise WeightSyncError(f"tensor {name!r} has dtype {t.dtype}, which cannot be synced")
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return metas, offset


def flatten_bucket(
    bucket: NamedTensors, device: torch.device | None = None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """One contiguous ``uint8`` buffer holding every tensor's bytes, and their layout."""
    metas, total = bucket_layout(bucket)
    if device is None:
        device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for meta, (_, t) in zip(metas, bucket, strict=True):
        if meta.nbytes:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[meta.offset : meta.offset + meta.nbytes].copy_(src, non_blocking=True)
    return flat, metas


def unflatten_bucket(flat: torch.Tensor, metas: Iterable[TensorMeta]) -> NamedTensors:
    """Views of ``flat`` as the named tensors ``flatten_bucket`` packed (no copy)."""
    out = []
    for meta in metas:
        piece = flat[meta.offset : meta.offset + meta.nbytes]
        out.append((meta.name, piece.view(DTYPES[meta.dtype]).view(meta.shape)))
    return out


class WeightSync(abc.ABC):
    """Pushes trainer weights into an inference engine as a new version."""

    method: ClassVar[str]
    # True for a method that moves a LoRA adapter (``push_adapter``) instead of whole weights.
    takes_adapter: ClassVar[bool] = False
    # True where the engine loads a push's buckets in one step between two of its own, so
    # the push needs no pause: generation goes on while the buckets travel.
    swaps_atomically: bool = False

    def __init__(
        self, *, timeout_s: float, dtype: torch.dtype | None = None, trainer_rank: int = 0
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.dtype = dtype
        self.trainer_rank = trainer_rank

    async def push(self, state: Iterable[NamedTensors], version: int) -> SyncResult | None:
        """Move ``state`` into the engine as ``version``. On ranks other than 0 this only
        walks the buckets (they may be collectives) and returns ``None``."""
        if self.trainer_rank != 0:
            for _ in state:
                pass
            return None
        start = time.perf_counter()
        tensors, nbytes = await self._push(state, int(version))
        return SyncResult(self.method, int(version), tensors, nbytes, time.perf_counter() - start)

    async def push_adapter(self, write: Callable[[Path], Path], version: int) -> SyncResult | None:
        """Move the trainer's LoRA adapter (``write(directory)`` puts it in PEFT's layout)
        into the engine as ``version``: only where ``takes_adapter``."""
        raise self._fail(version, "the engine", "this method moves whole weights, not adapters")

    @abc.abstractmethod
    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        """Send every bucket and make the engine serve ``version``; return (tensors, bytes)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most methods hold nothing
        """Release connections and files. Safe to call twice."""

    def _fail(self, version: int, peer: str, what: str) -> WeightSyncError:
        return WeightSyncError(f"{self.method} weight sync of version {version} to {peer}: {what}")


def check_engine_version(sync: WeightSync, engine: object, version: int, peer: str) -> None:
    """Raise unless ``engine.version`` is now ``version`` (trainer and engine must agree)."""
    got = getattr(engine, "version", None)
    if got != version:
        raise sync._fail(version, peer, f"the engine reports version {got} after the sync")
