"""Backward recasts the weights instead of keeping autocast's low-precision copies.

Under bf16 autocast each linear layer multiplies by a bfloat16 copy of its float32 weight,
and autograd saves that copy for the backward pass: from the end of a forward until the
backward reaches the layer, a copy of every weight is held beside the float32 master (0.27 GB
for SmolLM2-135M, at the moment a step's memory peaks). ``recast_weights_in_backward`` saves
a reference to the master instead and casts it again when the backward needs it, one layer
at a time. The master does not change between the two (the optimizer steps after the
backward), so the recast is the same copy bit for bit.

>>> with torch.autocast("cpu", dtype=torch.bfloat16), recast_weights_in_backward():  # doctest: +SKIP
...     loss = model(batch).sum()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch


class _Recast(NamedTuple):
    master: torch.Tensor
    dtype: torch.dtype
    transposed: bool


def _recast_of(tensor: torch.Tensor) -> _Recast | None:
    """How to rebuild ``tensor`` if it is a low-precision cast of a leaf (maybe transposed),
    as autocast makes for a weight; None for anything else."""
    node = tensor.grad_fn
    transposed = node is not None and node.name() == "TBackward0"
    if transposed:
        node = node.next_functions[0][0]
    if node is None or node.name() != "ToCopyBackward0":
        return None
    master = getattr(node.next_functions[0][0], "variable", None)
    if master is None or master.dtype == tensor.dtype or master.dim() != tensor.dim():
        return None
    shape = master.shape[::-1] if transposed else master.shape
    return _Recast(master, tensor.dtype, transposed) if tensor.shape == shape else None


def _pack(tensor: torch.Tensor) -> torch.Tensor | _Recast:
    return _recast_of(tensor) or tensor


def _unpack(saved: torch.Tensor | _Recast) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    copy = saved.master.detach().to(saved.dtype)
    return copy.t() if saved.transposed else copy


@contextlib.contextmanager
def recast_weights_in_backward() -> Iterator[None]:
    """Within this block, the graph keeps weights' low-precision casts as their masters."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
