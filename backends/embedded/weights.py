"""Loading new weights into a live model, in place, from named tensors or a safetensors dir.

Weights are copied into the existing parameters (``param.copy_``), so the KV cache, CUDA
graphs and tied embeddings stay valid. Names may carry the trainer's wrappers
(``module.``, ``_orig_mod.``, ``model.`` prefixes); they are matched to the model's own names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")

WeightSource = Mapping[str, torch.Tensor] | Path | str


class WeightUpdateError(ValueError):
    """New weights that do not fit the model: unknown names or wrong shapes."""


def iter_source(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a mapping, a ``.safetensors`` file or a directory of them."""
    if isinstance(source, Mapping):
        yield from source.items()
        return
    from safetensors import safe_open

    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"{path} holds no .safetensors files")
    elif path.is_file() and path.suffix == ".safetensors":
        files = [path]
    else:
        raise WeightUpdateError(
            f"{path} is neither a directory of .safetensors files nor one such file"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                yield name, f.get_tensor(name)


def _canonical(name: str, own: Mapping[str, torch.Tensor]) -> str | None:
    if name in own:
        return name
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :] in own:
            return name[len(prefix) :]
    if "model." + name in own:
        return "model." + name
    return None


@torch.no_grad()
def load_into(
    model: torch.nn.Module,
    source: WeightSource,
    *,
    writers: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> list[str]:
    """Copy every tensor of ``source`` into ``model``'s parameter or buffer of that name.

    ``writers`` take the values of the parameters (by the model's names) whose data is held
    elsewhere (the engine's packed copies); the parameter only gives name and shape.

    Returns the model's names of the tensors it wrote. Raises ``WeightUpdateError`` naming the first
    unknown name or mismatched shape; nothing is half-applied in that case when the source is
    a mapping (it is checked first). Directories are streamed tensor by tensor.
    """
    # remove_duplicate=False keeps tied names (lm_head.weight beside embed_tokens.weight).
    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    if isinstance(source, Mapping):
        for name, tensor in source.items():
            _check(name, tensor, own)
    on_cuda = next(model.parameters()).device.type == "cuda"
    if on_cuda:
        # The source may come from another stream (a trainer in this process): wait for it,
        # since the engine copies on its own stream.
        torch.cuda.synchronize()
    writers = writers or {}
    written = []
    for name, tensor in iter_source(source):
        key = _check(name, tensor, own)
        if key in writers:
            writers[key](tensor)
        else:
            target = own[key]
            target.copy_(tensor.to(device=target.device, dtype=target.dtype), non_blocking=True)
        written.append(key)
    if not written:
        raise WeightUpdateError("the weight source holds no tensors")
    if on_cuda:
        # Done before returning: the trainer may overwrite its tensors right after.
        torch.cuda.synchronize()
    return written


def _check(name: str, tensor: torch.Tensor, own: Mapping[str, torch.Tensor]) -> str:
    key = _canonical(name, own)
    if key is None:
        raise WeightUpdateError(f"unknown weight {name!r}: the model has no parameter of that name")
    if tuple(own[key].shape) != tuple(tensor.shape):
        raise WeightUpdateError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(own[key].shape)}"
        )
    return key


@torch.no_grad()
def own_memory(model: torch.nn.Module) -> None:
    """Give every CPU parameter and buffer of ``model`` memory of its own.

    A loader that maps the weights file (safetensors, as transformers loads it) leaves every
    tensor a view of that mapping, which stays mapped, each page read counted in the
    process's resident memory, while any one view lives. Once the engine's stacks hold most
    weights, the few tensors left (embedding, norms) would keep the whole file resident."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
