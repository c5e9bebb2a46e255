"""Training checkpoints in ``run.dir/checkpoints/step-N``: written whole or not at all.

``step-N`` is itself a Hugging Face model directory, so ``from_pretrained``,
``areal-sdk serve --model`` and other engines load it as it is; what only a resumed run
needs sits beside the model, where those loaders never look::

    step-N/
      config.json, generation_config.json        the run's model config
      tokenizer.json, tokenizer_config.json,     the run's tokenizer, chat template included
      chat_template.jinja, ...
      model.safetensors                          the trained weights under the model's own
                                                 names (sharded, with an index, when large)
      adapter/                                   train.lora only: the LoRA adapter in PEFT's
                                                 layout (adapter_config.json,
                                                 adapter_model.safetensors); model.safetensors
                                                 then holds the merged weights
      optimizer/                                 optimizer state (the newest checkpoint only,
                                                 unless run.keep_optimizer_state is ``all``)
      train_state.json                           the backend's step (written last by save)
      trainer_state.json                         step and weight version

The weights are stored as the trainer holds them (float32 master weights under the torch
backend), so a resumed run continues exactly; ``areal-sdk export`` writes bfloat16.

A checkpoint is written under a temporary name and renamed into place, so ``latest()``
never returns a half-written one after a crash.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from areal_sdk.train_backend import NamedTensors, TrainBackend

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_DIR = "optimizer"
ADAPTER_DIR = "adapter"
SINGLE_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# One shard per bucket of the backend's weights: under ZeRO-3 every rank gathers one
# bucket at a time, so this is also the extra memory a save takes.
SHARD_BYTES = 2 << 30
_STEP_DIR = re.compile(r"step-(\d+)")

KeepOptimizerState = Literal["latest", "all"]


@dataclass(frozen=True)
class Checkpoint:
    step: int
    version: int
    path: Path

    @property
    def has_optimizer_state(self) -> bool:
        return (self.path / OPTIMIZER_DIR).exists()


class Checkpoints:
    """The checkpoints of one run: the newest ``keep`` kept, optimizer state in the newest
    only unless ``keep_optimizer_state`` is ``"all"`` (it is twice the size of a float32
    model under AdamW)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        keep: int = 2,
        keep_optimizer_state: KeepOptimizerState = "latest",
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.keep_optimizer_state = keep_optimizer_state

    def all(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first."""
        found = []
        if not self.root.is_dir():
            return found
        for child in self.root.iterdir():
            match = _STEP_DIR.fullmatch(child.name)
            state = child / TRAINER_STATE
            if match is None or not state.is_file():
                continue
            data = json.loads(state.read_text())
            found.append(Checkpoint(int(data["step"]), int(data["version"]), child))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        every = self.all()
        return every[-1] if every else None

    def at_step(self, step: int) -> Checkpoint:
        """The checkpoint of ``step``; the error lists the steps there are."""
        every = self.all()
        for checkpoint in every:
            if checkpoint.step == step:
                return checkpoint
        steps = ", ".join(str(c.step) for c in every) or "none"
        raise FileNotFoundError(f"no checkpoint of step {step} in {self.root} (steps: {steps})")

    def save(self, backend: TrainBackend) -> Checkpoint:
        """Write the backend's state as ``step-<backend.step>`` and prune older ones."""
        step = backend.step
        final = self.root / f"step-{step}"
        staging = self.root / f".step-{step}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        backend.save(staging)
        if backend.rank == 0:
            state = {"step": step, "version": backend.version}
            (staging / TRAINER_STATE).write_text(json.dumps(state))
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            every = self.all()
            for old in every[: -self.keep]:
                shutil.rmtree(old.path, ignore_errors=True)
            if self.keep_optimizer_state == "latest":
                for old in every[-self.keep : -1]:
                    shutil.rmtree(old.path / OPTIMIZER_DIR, ignore_errors=True)
        return Checkpoint(step, backend.version, final)


# -- the model directory -------------------------------------------------------------------


class ModelFiles:
    """What a checkpoint's model directory holds besides the weights, read once from the
    run's model source: its config, generation config and tokenizer (chat template too)."""

    def __init__(self, config: Any, generation_config: Any, tokenizer: Any) -> None:
        self.config = config
        self.generation_config = generation_config
        self.tokenizer = tokenizer

    @classmethod
    def from_source(
        cls, model_dir: str | Path, tokenizer_dir: str | Path | None = None
    ) -> ModelFiles:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
        except OSError:
            generation = GenerationConfig.from_model_config(config)
        source = tokenizer_dir or model_dir
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"no tokenizer in {source} for the checkpoints' model directory; set "
                f"model.tokenizer to a directory that has one ({exc})"
            ) from exc
        return cls(config, generation, tokenizer)

    def write(self, directory: str | Path, weights_dtype: torch.dtype) -> None:
        """The config (stating ``weights_dtype``), generation config and tokenizer."""
        config = copy.deepcopy(self.config)
        config.dtype = weights_dtype
        config.save_pretrained(directory)
        self.generation_config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def write_weights(buckets: Iterable[NamedTensors], directory: str | Path) -> torch.dtype:
    """Write HF safetensors into ``directory``: one shard per bucket, ``model.safetensors``
    alone when there is one. Returns the weights' (first) dtype, for the config."""
    return write_safetensors(buckets, directory).dtype


@dataclass(frozen=True)
class WrittenWeights:
    dtype: torch.dtype  # the first tensor's
    tensors: int
    nbytes: int


def write_safetensors(buckets: Iterable[NamedTensors], directory: str | Path) -> WrittenWeights:
    """``write_weights``, saying what was written; ``ValueError`` when there was nothing."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shards: list[str] = []
    total = 0
    dtype = torch.float32
    for bucket in buckets:
        if not bucket:
            continue
        tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
        if not shards:
            dtype = next(iter(tensors.values())).dtype
        shard = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        shards.append(shard)
        for name, t in tensors.items():
            weight_map[name] = shard
            total += t.numel() * t.element_size()
    if not shards:
        raise ValueError("no weights to write")
    written = WrittenWeights(dtype, len(weight_map), total)
    if len(shards) == 1:
        os.replace(directory / shards[0], directory / SINGLE_FILE)
        return written
    # HF names shards model-0000k-of-0000n; the count is known only now.
    renamed = {
        s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards)
    }
    for old, new in renamed.items():
        os.replace(directory / old, directory / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: renamed[s] for name, s in sorted(weight_map.items())},
    }
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
    return written


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors (single file or sharded), on the CPU."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / SINGLE_FILE).is_file():
        shards = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{directory} holds no model weights ({SINGLE_FILE})")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(directory / shard)))
    return weights
