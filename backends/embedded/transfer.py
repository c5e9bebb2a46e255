"""Host lists to device tensors without stalling the engine's stream."""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device``. On CUDA the values go through pinned memory and
    an asynchronous copy: a copy from pageable memory waits for the stream's queued work, so
    the host would sit idle until the GPU finished the step before it could queue the next
    kernels. torch's caching host allocator keeps the pinned block alive until the copy
    has run."""
    host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
