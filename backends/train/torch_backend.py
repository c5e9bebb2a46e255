"""The ``torch`` train backend: one process, CPU or one GPU, torch AdamW (``optimizer``).

bf16 (``train.bf16``) keeps float32 master weights and runs forward/backward under
``torch.autocast`` (bfloat16). Gradient checkpointing is HF's, non-reentrant. Micro-batches
are packed and padding-free (``areal_sdk.packing``); logprobs come from the final hidden
states through the chunked ``token_logprobs_and_entropy``.

>>> backend = TorchBackend("/models/tiny", TrainConfig(lr=1e-5))   # doctest: +SKIP
>>> metrics = backend.train_step(micro_batches, loss_fn)           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from areal_sdk.backends.train.defaults import (
    compile_by_default,
    engine_shares_device,
    micro_batch_tokens_for,
)
from areal_sdk.backends.train.lora import add_lora, load_adapter, merged_tensors, save_adapter
from areal_sdk.backends.train.optimizer import build_adamw
from areal_sdk.backends.train.policy import (
    assign_weights,
    hf_name,
    load_policy,
    merge_metrics,
    plan_buckets,
    read_step_metrics,
)
from areal_sdk.backends.train.weight_casts import recast_weights_in_backward

from areal_sdk.checkpoints import (
    ADAPTER_DIR,
    OPTIMIZER_DIR,
    SHARD_BYTES,
    ModelFiles,
    read_weights,
    write_weights,
)
from areal_sdk.config import TrainConfig
from areal_sdk.malloc import release_free_memory
from areal_sdk.train_backend import LossFn, NamedTensors, TrainBackend, loss_weight_of

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.packing import MicroBatch

META_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.pt"


def resolve_device(name: str) -> torch.device:
    """``"cuda"`` / ``"cuda:1"`` / ``"cpu"``, failing clearly when CUDA is asked for but absent."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device is {name!r} but CUDA is not available here")
    return device


def bf16_runs_fast(device: torch.device) -> bool:
    """Whether bfloat16 matrix products are native on ``device``.

    Always on CUDA. On a CPU only with AVX512-BF16 or AMX: elsewhere torch falls back to a
    scalar kernel that runs a bf16 product 30-60x slower than float32 (a training step of
    SmolLM2-135M took 5 minutes instead of 10 seconds on an AVX2-only EPYC).
    """
    if device.type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def use_bf16(requested: bool | None, device: torch.device) -> bool:
    """``train.bf16`` as it can run here: on a CPU without native bf16, float32 instead.
    Unset, bf16 on CUDA (the fast path there) and float32 on a CPU."""
    if requested is None:
        return device.type == "cuda"
    if requested and not bf16_runs_fast(device):
        log.warning(
            "train.bf16 is set, but this CPU has no native bfloat16 matrix products "
            "(AVX512-BF16 or AMX), where they run tens of times slower than float32: "
            "training in float32"
        )
        return False
    return requested


def model_path_of(config: Config) -> str:
    """The local HF directory to train: ``model.path``, or ``model.name`` resolved through the
    registry (the same converted directory the embedded engine serves). A .gguf file is
    converted once into the cache: the weights the engine reads from the file, and a
    tokenizer and config on disk for the checkpoints."""
    from areal_sdk.models import hf_dir_of, resolve

    source = config.model.path or config.model.name
    if source is None:
        raise ValueError("the train backend needs model.path or model.name")
    return str(hf_dir_of(resolve(source)))


class TorchBackend(TrainBackend):
    """Single-process training of a local HF causal LM."""

    def __init__(
        self,
        model_path: str | Path,
        train: TrainConfig | None = None,
        *,
        temperature: float = 1.0,
        initial_version: int = 0,
        tokenizer_path: str | Path | None = None,
        shares_device: bool = False,
    ) -> None:
        self.cfg = train or TrainConfig()
        self._device = resolve_device(self.cfg.device)
        self.bf16 = use_bf16(self.cfg.bf16, self._device)
        self.initial_version = initial_version
        # What each checkpoint's model directory holds besides the weights.
        self.model_files = ModelFiles.from_source(model_path, tokenizer_path)
        self.model = load_policy(
            model_path,
            attn_implementation=self.cfg.attn_implementation,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
            temperature=temperature,
            chunk_size=self.cfg.logprob_chunk_size,
            logprob_backend=self.cfg.logprob_backend,
            padded_attention=self.cfg.padded_attention,
            varlen_kernel=self.cfg.varlen_kernel,
            compile_layers=compile_by_default(self.cfg.compile, self._device),
        )
        # train.lora: adapters injected into the policy, every other weight frozen.
        self.adapter = add_lora(self.model.policy, self.cfg.lora) if self.cfg.lora else None
        self.model.to(self._device)
        self.micro_batch_tokens = self.cfg.micro_batch_tokens or micro_batch_tokens_for(
            self.model,
            self._device,
            compiled=compile_by_default(self.cfg.compile, self._device),
            checkpointing=self.cfg.gradient_checkpointing,
            shares_device=shares_device,
            stored_softmax=self.cfg.logprob_backend == "stored",
        )
        self.optimizer = build_adamw(
            [p for p in self.model.parameters() if p.requires_grad], self.cfg, self._device
        )
        self._step = 0

    @classmethod
    def from_config(cls, config: Config) -> TorchBackend:
        """The factory registered as train backend ``torch``."""
        return cls(
            model_path_of(config),
            config.train,
            temperature=config.inference.temperature,
            tokenizer_path=config.model.tokenizer,
            shares_device=engine_shares_device(config),
        )

    # -- properties ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @property
    def device(self) -> torch.device:
        return self._device

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.bf16:
            return contextlib.nullcontext()
        # autocast's cache keeps each weight's bf16 copy until the forward ends; every weight
        # is used once, so on a CPU, where memory is what runs out, copies die after use.
        cache = self._device.type != "cpu"
        return torch.autocast(self._device.type, dtype=torch.bfloat16, cache_enabled=cache)

    # -- compute ---------------------------------------------------------------------------

    def _keep_weights(self) -> contextlib.AbstractContextManager[Any]:
        # And the backward casts each weight again rather than keep its copy from the forward
        # (weight_casts): 0.2 GB less at a CPU step's peak for SmolLM2-135M.
        if self.bf16 and self._device.type == "cpu":
            return recast_weights_in_backward()
        return contextlib.nullcontext()

    def _run(
        self, batch: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._autocast(), self._keep_weights():
            return self.model(
                batch.input_ids,
                batch.position_ids,
                batch.cu_seqlens,
                with_entropy,
                batch.parents,
                batch.head_rows,
            )

    @torch.no_grad()
    def forward_logprobs(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for batch in batches:
                logprobs, _ = self._run(batch.to(self._device), with_entropy=False)
                out.append(logprobs.float().cpu())
            return out
        finally:
            self.model.train(was_training)

    def train_step(self, batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        if not batches:
            raise ValueError("train_step needs at least one micro-batch")
        weights = [loss_weight_of(loss_fn, b) for b in batches]
        total = sum(weights)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[tuple[float, Mapping[str, float | torch.Tensor]]] = []
        losses: list[torch.Tensor] = []
        for batch, weight in zip(batches, weights, strict=True):
            share = weight / total if total > 0 else 0.0
            mb = batch.to(self._device)
            logprobs, entropy = self._run(mb, with_entropy=True)
            loss, metrics = loss_fn(logprobs.float(), entropy, mb)
            if self._device.type == "cpu":
                # The forward's temporaries (and autocast's weight copies) are freed: hand
                # their pages back before the backward's peak rather than after it.
                release_free_memory()
            (loss * share).backward()
            losses.append(loss)
            parts.append((share, metrics))
            if self._device.type == "cpu":
                # The micro-batch's activations are freed: hand their pages back before the
                # next one allocates its own elsewhere in the arena (areal_sdk.malloc).
                release_free_memory()
        read, step_loss = read_step_metrics(parts, losses)
        metrics = merge_metrics(read)
        metrics.update(self._apply_gradients(skip=total <= 0))
        metrics["loss"] = step_loss
        metrics["tokens"] = float(sum(b.num_tokens for b in batches))
        if self._device.type == "cpu":
            # The step's activations and logits are freed; hand their pages back rather than
            # keep them in this worker thread's malloc arena (areal_sdk.malloc).
            release_free_memory()
        return metrics

    def _apply_gradients(self, *, skip: bool) -> dict[str, float]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if skip or not math.isfinite(grad_norm):
            # Nothing to learn from (all padding), or a bad batch: keep the weights.
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0}

    # -- weights out -----------------------------------------------------------------------

    @property
    def trains_adapter(self) -> bool:
        return self.adapter is not None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters under their HF names (tied weights once)."""
        return [(hf_name(n), p) for n, p in self.model.named_parameters()]

    @torch.no_grad()
    def state_for_sync(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The weights under the base model's names; with ``train.lora``, merged with the
        adapters one tensor at a time (the trained weights themselves stay unmerged)."""
        if self.adapter is not None:
            merged = merged_tensors(self.model)
            sizes = [m.params[0].numel() * m.params[0].element_size() for m in merged]
            for bucket in plan_buckets(sizes, bucket_bytes):
                yield [(merged[i].name, merged[i].compute()) for i in bucket]
            return
        named = self.named_parameters()
        sizes = [p.numel() * p.element_size() for _, p in named]
        for bucket in plan_buckets(sizes, bucket_bytes):
            yield [(named[i][0], named[i][1].detach()) for i in bucket]

    def save_adapter(self, directory: str | Path) -> Path:
        if self.adapter is None:
            raise ValueError("this run trains every weight (train.lora is not set): no adapter")
        return save_adapter(self.adapter, directory)

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """An HF model directory of the float32 weights (merged, under ``train.lora``, with
        the adapter in ``adapter/``), the optimizer state beside it."""
        directory = Path(directory)
        dtype = write_weights(self.state_for_sync(SHARD_BYTES), directory)
        self.model_files.write(directory, dtype)
        if self.adapter is not None:
            save_adapter(self.adapter, directory / ADAPTER_DIR)
        (directory / OPTIMIZER_DIR).mkdir(exist_ok=True)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_DIR / OPTIMIZER_FILE)
        # Written last: a directory with this file holds a complete checkpoint.
        meta = {
            "backend": "torch",
            "step": self._step,
            "initial_version": self.initial_version,
            "lora": self.adapter is not None,
        }
        (directory / META_FILE).write_text(json.dumps(meta))

    def load(self, directory: str | Path) -> None:
        directory = Path(directory)
        meta = read_meta(directory, "torch")
        check_lora_matches(meta, self.cfg, directory)
        optimizer = directory / OPTIMIZER_DIR / OPTIMIZER_FILE
        if self.adapter is not None:
            # The base weights are the run's model, as loaded; only the adapter trained.
            load_adapter(self.adapter, directory / ADAPTER_DIR, self.cfg.lora)
        elif (directory / "config.json").is_file():
            assign_weights(self.named_parameters(), read_weights(directory), directory)
        else:
            optimizer = self._load_old_layout(directory)
        if not optimizer.is_file():
            raise FileNotFoundError(
                f"{directory} holds the model but no optimizer state to resume from: "
                "run.keep_optimizer_state: latest keeps it in the newest checkpoint only"
            )
        state = torch.load(optimizer, map_location=self._device, weights_only=True)
        self.optimizer.load_state_dict(state)
        self._step = int(meta["step"])
        self.initial_version = int(meta.get("initial_version", 0))

    def _load_old_layout(self, directory: Path) -> Path:
        """A checkpoint of areal-sdk before model directories: the wrapped model's tensors
        (``policy.``-prefixed names) and ``optimizer.pt`` side by side."""
        from safetensors.torch import load_model

        load_model(self.model, str(directory / "model.safetensors"), device=str(self._device))
        return directory / OPTIMIZER_FILE


def check_lora_matches(meta: Mapping[str, Any], cfg: TrainConfig, directory: Path) -> None:
    """A checkpoint resumes only the kind of training that wrote it (adapters or all)."""
    saved, now = bool(meta.get("lora", False)), cfg.lora is not None
    if saved != now:
        wrote = "LoRA adapters" if saved else "every weight (no train.lora)"
        wants = "LoRA adapters" if now else "every weight"
        raise ValueError(
            f"{directory} was written by a run that trained {wrote}; this run trains {wants}: "
            "set train.lora as that run did"
        )


def read_meta(directory: Path, backend: str) -> dict[str, Any]:
    """The checkpoint's ``train_state.json``, checked to be ``backend``'s."""
    path = directory / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete checkpoint (no {META_FILE})")
    meta = json.loads(path.read_text())
    if meta.get("backend") != backend:
        raise ValueError(
            f"{directory} is a {meta.get('backend')!r} checkpoint; the {backend!r} backend "
            "cannot load it"
        )
    return meta
