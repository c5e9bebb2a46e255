"""Linear layers with their weights prepacked for oneDNN, for the engine on CPU.

``F.linear`` on CPU hands a plain row-major weight to the GEMM library on every call, which
re-blocks it before multiplying. At a decode step's shape (16 rows) that is most of the
cost: SmolLM2's ``[16, 576] x [576, 49152]`` head takes 20 ms in float32 through
``F.linear`` and 5.4 ms from a prepacked weight, a ``[16, 576] x [576, 1536]`` projection
265 against 152 us (bf16: 161 against 91 us; ``benchmarks/engine.md``). This is what a CPU
serving stack does (oneDNN's prepacked matmul, as torch's own inductor uses after
freezing); the products are the same to float rounding.

``PackedLinears(model)`` keeps every ``nn.Linear`` of the model as it is (its parameters
still hold the weights, which ``load_into`` overwrites and tied embeddings share) and adds a
packed copy that the module's forward multiplies with outside autograd. After parameters
change, ``repack(names)`` rebuilds the copies of the layers whose weights they are; a
forward that records gradients, or whose input has another dtype, takes ``F.linear``.
``remove()`` gives the layers their plain forward back (the engine does so on close: the
model may be the caller's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

_DTYPES = (torch.float32, torch.bfloat16)
T = TypeVar("T")


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build can multiply prepacked ``dtype`` weights on ``device``."""
    if device.type != "cpu" or dtype not in _DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    # bf16 only where the CPU multiplies it natively (AVX512-BF16, AMX): the packed path was
    # measured there, and elsewhere training already falls back to float32 for the same reason.
    return dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())


class CopiesByName(Generic[T]):
    """What was derived from each of a model's parameters (packed or stacked copies), by every
    name the parameter goes by: tied names included (``lm_head.weight`` is
    ``model.embed_tokens.weight`` in a tied model, and a weight source may write either)."""

    def __init__(
        self, model: torch.nn.Module, copies_of: Callable[[torch.nn.Parameter], list[T]]
    ) -> None:
        self._by_name = {
            name: copies_of(param) for name, param in model.named_parameters(remove_duplicate=False)
        }

    def stale(self, names: Iterable[str]) -> list[T]:
        """The copies that parameters ``names`` feed, each once."""
        return list({id(c): c for n in names for c in self._by_name.get(n, ())}.values())


class PackedLinears:
    """The packed weights of one model's linear layers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, skip: Iterable[torch.nn.Module] = ()) -> None:
        """Pack every linear layer of ``model`` but those in ``skip`` (which multiply weights
        packed elsewhere, e.g. fused with their neighbours)."""
        skipped = {id(m) for m in skip}
        self.linears = [
            m
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
            and id(m) not in skipped
            and m.weight.device.type == "cpu"
            and m.weight.dtype in _DTYPES
        ]
        self._by_name = CopiesByName(model, lambda p: [m for m in self.linears if m.weight is p])
        self.repack()
        for linear in self.linears:
            linear.forward = functools.partial(_forward, linear)  # type: ignore[method-assign]

    @torch.no_grad()
    def repack(self, names: Iterable[str] | None = None) -> None:
        """Rebuild the packed copies of the layers whose weights ``names`` are (the
        model's own parameter names, as ``load_into`` returns them); all without names."""
        for m in self.linears if names is None else self._by_name.stale(names):
            # Kept on the module, where its forward reads it.
            m._areal_packed = pack_weight(m.weight.detach())

    def remove(self) -> None:
        """Give every layer its plain forward back and drop the packed copies."""
        for m in self.linears:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_areal_packed", None)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered once into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``pack_weight(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != linear.weight.dtype or torch.is_grad_enabled():
        return F.linear(x, linear.weight, linear.bias)
    return packed_linear(x, linear._areal_packed, linear.bias)
