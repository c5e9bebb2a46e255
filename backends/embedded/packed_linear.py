"""Linear layers with their weights prepacked for oneDNN, for the engine on CPU.

``F.linear`` on CPU hands a plain row-major weight to the GEMM library on every call, which
re-blocks it before multiplying. At a decode step's shape (16 rows) that is most of the
cost: SmolLM2's ``[16, 576] x [576, 49152]`` head takes 20 ms in float32 through
``F.linear`` and 5.4 ms from a prepacked weight, a ``[16, 576] x [576, 1536]`` projection
265 against 152 us (bf16: 161 against 91 us; ``benchmarks/engine.md``). This is what a CPU
serving stack does (oneDNN's prepacked matmul, as torch's own inductor uses after
freezing); the products are the same to float rounding.

``StackedLinear`` is one product whose weight stacks the rows of one or more linear layers
(one layer; q, k and v; gate and up), prepacked or plain. Keeping the layers' own weights
beside it would hold every weight twice (0.4 GiB more for SmolLM2 in float32), so the
engine makes the stack the sole copy (``take_weights``): the layers' weight parameters
become meta tensors (same names and shapes, no memory) and a weight update writes new
values through ``write``. A weight that another module also reads (a head tied to the
embedding) keeps its parameter.

A plain (unpacked) stack keeps its storage for life: new weights and biases are copied
into it. The engine's CUDA graphs read the addresses they were captured with, so a stack
that took a new tensor on an update would leave every replay on the old weights, and on
freed memory once the allocator gives it back.

``PackedLinears(model)`` packs every ``nn.Linear`` of the model on its own and gives it a
forward that multiplies the packed copy outside autograd. After parameters change,
``repack(names)`` rebuilds the copies of the layers whose weights they are. ``SoleCopies``
makes stacks the sole copies; ``restore()`` there and ``remove()`` here give the layers
their weights and plain forwards back (the engine does so on close: the model may be the
caller's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
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


def shared_weights(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters that more than one module holds (tied embeddings)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    return {key for key, count in holders.items() if count > 1}


class StackedLinear:
    """``x @ W.T + b`` with ``W`` the rows of ``linears``' weights stacked (see the module
    docstring); ``packed`` reorders ``W`` for oneDNN."""

    def __init__(self, linears: list[torch.nn.Linear], *, packed: bool) -> None:
        self.linears = linears
        self.packed = packed
        self.sole_copy = False
        first = linears[0].weight
        self.dtype, self.device = first.dtype, first.device
        sizes = [m.out_features for m in linears]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self._requires_grad = [m.weight.requires_grad for m in linears]
        self._staged: dict[int, torch.Tensor] = {}
        self.weight: torch.Tensor
        self.bias: torch.Tensor | None
        self.rebuild()

    def take_weights(self) -> None:
        """Become the sole copy of the layers' weights: their parameters turn into meta
        tensors of the same shapes, and new values come through ``write``."""
        for m in self.linears:
            m.weight = torch.nn.Parameter(
                torch.empty_like(m.weight, device="meta"), requires_grad=False
            )
        self.sole_copy = True

    @torch.no_grad()
    def rebuild(self) -> None:
        """Rebuild from the layers' parameters (biases only, where the stack is the sole
        copy of the weights)."""
        if not self.sole_copy:
            self._set_weight(torch.cat([m.weight.detach() for m in self.linears]))
        biases = [m.bias for m in self.linears]
        if all(b is None for b in biases):
            self.bias = None
        elif len(self.linears) == 1:
            self.bias = biases[0]
        else:
            self.bias = _into(
                getattr(self, "bias", None),
                torch.cat(
                    [
                        b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                        for m, b in zip(self.linears, biases, strict=True)
                    ]
                ),
            )

    def _set_weight(self, weight: torch.Tensor) -> None:
        if self.packed:
            self.weight = pack_weight(weight)
        else:
            self.weight = _into(getattr(self, "weight", None), weight)

    def plain_weight(self) -> torch.Tensor:
        """The stacked weight in plain row-major layout (a new tensor when packed)."""
        return self.weight.to_dense() if self.packed else self.weight

    @torch.no_grad()
    def write(self, index: int, value: torch.Tensor) -> None:
        """New values for layer ``index``'s weight (a sole copy only). The stack is rebuilt
        once every layer has one; ``flush`` applies a partial set."""
        if not self.sole_copy:
            raise RuntimeError("write is for stacks that hold the sole copy of their weights")
        if not self.packed:  # straight into the stack's rows (see the module docstring)
            self.weight[self.bounds[index] : self.bounds[index + 1]].copy_(value)
            return
        self._staged[index] = value.to(device=self.device, dtype=self.dtype)
        if len(self._staged) == len(self.linears):
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """Apply the values ``write`` staged: stacked as they are when every layer has one,
        else spliced into the current weight."""
        if not self._staged:
            return
        if len(self._staged) == len(self.linears):
            weight = torch.cat([self._staged[i] for i in range(len(self.linears))])
        else:
            weight = self.plain_weight()
            for i, value in self._staged.items():
                weight[self.bounds[i] : self.bounds[i + 1]] = value
        self._staged.clear()
        self._set_weight(weight)

    def restore(self) -> None:
        """Give the layers their own weight parameters back (from the stack when it holds
        the sole copy)."""
        if not self.sole_copy:
            return
        weight = self.plain_weight()
        for i, m in enumerate(self.linears):
            rows = weight[self.bounds[i] : self.bounds[i + 1]].clone()
            m.weight = torch.nn.Parameter(rows, requires_grad=self._requires_grad[i])
        self.sole_copy = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def rows_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s own output for input ``x``: the stack's product, sliced."""
        out = self(x)
        if len(self.linears) == 1:
            return out
        return out[..., self.bounds[index] : self.bounds[index + 1]]


class SoleCopies:
    """Stacks made the sole copy of their layers' weights (see the module docstring).

    Every stack of ``stacks`` whose weights no other module reads takes them over
    (``take_weights``) and its layers' forwards run through it. ``writers`` maps every name
    of those weights to where a weight update writes its value; ``flush`` applies partial
    sets; ``restore`` gives the layers their weights and forwards back."""

    def __init__(self, model: torch.nn.Module, stacks: Iterable[StackedLinear]) -> None:
        shared = shared_weights(model)
        self.stacks = [s for s in stacks if not any(id(m.weight) in shared for m in s.linears)]
        member = {id(m.weight): (s, i) for s in self.stacks for i, m in enumerate(s.linears)}
        self._where = {
            name: member[id(p)]
            for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in member
        }
        self.writers: dict[str, Callable[[torch.Tensor], None]] = {
            name: functools.partial(stack.write, index)
            for name, (stack, index) in self._where.items()
        }
        for stack in self.stacks:
            stack.take_weights()
        forward_through({m: (s, i) for s in self.stacks for i, m in enumerate(s.linears)})

    def weight(self, name: str) -> torch.Tensor | None:
        """The value of weight ``name`` if a stack holds it (a new plain tensor), else None."""
        where = self._where.get(name)
        if where is None:
            return None
        stack, index = where
        return stack.plain_weight()[stack.bounds[index] : stack.bounds[index + 1]].clone()

    def flush(self) -> None:
        """Apply the values written to only some layers of a stack."""
        for stack in self.stacks:
            stack.flush()

    def restore(self) -> None:
        """Give the layers their weight parameters and plain forwards back."""
        for stack in self.stacks:
            stack.restore()
        plain_forward(m for s in self.stacks for m in s.linears)


def forward_through(linears: Mapping[torch.nn.Linear, tuple[StackedLinear, int]]) -> None:
    """Give each linear layer a forward through its stack (the plain weight may be gone).

    A forward that records gradients, or whose input has another dtype, takes ``F.linear``
    on the layer's own weight, where it still has one."""
    for linear, (stack, index) in linears.items():
        linear.forward = functools.partial(_forward, linear, stack, index)  # type: ignore[method-assign]
        linear._areal_packed = stack  # where a reader (and ``remove``) finds it


def plain_forward(linears: Iterable[torch.nn.Linear]) -> None:
    """Undo ``forward_through``."""
    for m in linears:
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_areal_packed", None)


def _forward(
    linear: torch.nn.Linear, stack: StackedLinear, index: int, x: torch.Tensor
) -> torch.Tensor:
    if not stack.sole_copy and (x.dtype != stack.dtype or torch.is_grad_enabled()):
        return F.linear(x, linear.weight, linear.bias)
    return stack.rows_of(index, x)


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
        self.stacks = {m: StackedLinear([m], packed=True) for m in self.linears}
        forward_through({m: (s, 0) for m, s in self.stacks.items()})

    @torch.no_grad()
    def repack(self, names: Iterable[str] | None = None) -> None:
        """Rebuild the packed copies of the layers whose parameters ``names`` are (the
        model's own parameter names, as ``load_into`` returns them); all without names."""
        for m in self.linears if names is None else self._by_name.stale(names):
            self.stacks[m].rebuild()

    def remove(self) -> None:
        """Give every layer its plain forward back and drop the packed copies."""
        plain_forward(self.linears)


def _into(held: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``held`` where it fits (the storage stays), else ``value``."""
    if (
        held is not None
        and held.shape == value.shape
        and held.dtype == value.dtype
        and held.device == value.device
    ):
        return held.copy_(value)
    return value


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered once into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from ``pack_weight(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
