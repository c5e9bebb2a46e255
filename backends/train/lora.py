"""LoRA training (``train.lora``): ``peft`` adapters on the policy, merged weights out.

``add_lora`` injects PEFT's LoRA layers into the policy's HF model in place and freezes every
other weight, so the optimizer holds only the adapters. What leaves the trainer:

- to an engine that loads full weights (the embedded engine, any disk/broadcast push):
  ``merged_tensors``, the base model's own parameter names with ``W + B @ A * alpha / r``
  computed on the fly, never merged in place (training goes on from the unmerged weights);
- to an engine that serves adapters (SGLang's ``/load_lora_adapter``): the adapter itself,
  written by ``save_adapter`` in PEFT's layout (``adapter_config.json``,
  ``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` loads on the base.

Both train backends use these functions, so the torch and DeepSpeed paths stay alike; under
ZeRO-3 the backend gathers a ``MergedTensor``'s ``params`` before calling ``compute``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from areal_sdk.backends.train.policy import hf_name
from torch import nn

from areal_sdk.config import ConfigError

if TYPE_CHECKING:
    from peft import PeftModel

    from areal_sdk.config import LoraConfig

ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"
# The adapters' random initial A matrices come from this seed: every rank of a job starts
# from the same adapters (ZeRO-3 partitions each rank's own copy), and so does every run.
INIT_SEED = 0


def import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError('train.lora needs peft: pip install "areal-sdk[lora]"') from None
    return peft


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name components of the model's linear layers (what
    ``target_modules`` may name)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )


def _unmatched(model: nn.Module, targets: str | list[str]) -> list[str]:
    """The targets that name no module of ``model``, by PEFT's rule: a list entry matches a
    module whose name is it or ends with ``.`` + it; a string other than ``all-linear`` is a
    regular expression a whole module name must match."""
    names = [name for name, _ in model.named_modules()]
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return []
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise ConfigError(
                f"train.lora.target_modules: {targets!r} is neither all-linear nor a valid "
                f"regular expression ({exc})"
            ) from None
        return [] if any(pattern.fullmatch(n) for n in names) else [targets]
    return [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]


def add_lora(model: nn.Module, settings: LoraConfig) -> PeftModel:
    """Inject LoRA adapters into the HF causal LM ``model`` in place (its other weights
    frozen) and return the ``PeftModel`` around it (for saving and loading the adapter).

    Targets that name nothing in the model, or a module that cannot take an adapter, raise
    ``ConfigError`` naming ``train.lora.target_modules`` and the model's linear layers.
    """
    peft = import_peft()
    targets = settings.target_modules
    known = ", ".join(linear_names(model))
    unmatched = _unmatched(model, targets)
    if unmatched:
        raise ConfigError(
            f"train.lora.target_modules: {unmatched} names no module of "
            f"{type(model).__name__}; its linear layers are: {known}"
        )
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            return peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    except ValueError as exc:
        raise ConfigError(
            f"train.lora.target_modules {targets!r}: {exc} (linear layers: {known})"
        ) from None


@dataclass(frozen=True)
class MergedTensor:
    """One tensor of the merged model: ``compute()`` gives it once ``params`` are whole."""

    name: str  # the base model's own (HF) name
    params: tuple[nn.Parameter, ...]  # params[0] is the base tensor, the shape of the result
    compute: Callable[[], torch.Tensor]


def merged_tensors(module: nn.Module) -> list[MergedTensor]:
    """Every weight of ``module`` (a ``PackedPolicy`` with adapters) as the merged model
    names it: a LoRA layer's base weight plus its delta, every other weight as it is."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    out: list[MergedTensor] = []
    for name, param in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            continue  # the adapter: it lives on in the merged weight
        plain = hf_name(name.replace(".base_layer.", "."))
        layer = layers.get(owner.removesuffix(".base_layer"))
        if layer is not None and owner.endswith(".base_layer") and leaf == "weight":
            lora = (
                *layer.lora_A[ADAPTER_NAME].parameters(),
                *layer.lora_B[ADAPTER_NAME].parameters(),
            )
            out.append(MergedTensor(plain, (param, *lora), _merge(layer, param)))
        else:
            out.append(MergedTensor(plain, (param,), param.detach))
    return out


def _merge(layer: Any, weight: nn.Parameter) -> Callable[[], torch.Tensor]:
    def compute() -> torch.Tensor:
        with torch.no_grad():
            delta = layer.get_delta_weight(ADAPTER_NAME)
            return weight.detach() + delta.to(weight.dtype)

    return compute


def adapter_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The adapter's parameters (what trains)."""
    return [p for name, p in module.named_parameters() if ".lora_" in name]


def save_adapter(peft_model: PeftModel, directory: str | Path) -> Path:
    """The adapter in PEFT's layout in ``directory``: ``adapter_config.json`` and
    ``adapter_model.safetensors``."""
    directory = Path(directory)
    peft_model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def load_adapter(peft_model: PeftModel, directory: str | Path, settings: LoraConfig) -> None:
    """Load the adapter ``save_adapter`` wrote into ``peft_model``; an adapter of another
    shape than ``train.lora`` asks for (rank, targets) is refused whole."""
    import json

    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    directory = Path(directory)
    config_file = directory / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} holds no LoRA adapter ({ADAPTER_CONFIG})")
    saved = json.loads(config_file.read_text())
    if saved.get("r") != settings.r:
        raise ValueError(
            f"the adapter in {directory} has rank {saved.get('r')}, train.lora.r is {settings.r}"
        )
    weights = load_peft_weights(str(directory), device="cpu")
    result = set_peft_model_state_dict(peft_model, weights, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"the adapter in {directory} does not fit train.lora.target_modules: missing "
            f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}"
        )
