"""The ``deepspeed`` train backend: ZeRO stage 0-3, bf16, gradient checkpointing.

Nothing compiles: the optimizer is plain ``torch.optim.AdamW`` handed to DeepSpeed as the
client optimizer (so no FusedAdam / CPUAdam JIT build), and DeepSpeed is installed with its
default ``DS_BUILD_OPS=0``. Runs on CUDA over NCCL, and on CPU over gloo, which is how the
tests run it: for ``train.device=cpu`` the backend sets ``DS_ACCELERATOR=cpu`` before
DeepSpeed is imported (DeepSpeed picks its accelerator once per process, at import).

Ranks. Launched by ``deepspeed``/``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set), each rank builds the backend with its share of the micro-batches
(``pack_samples(..., num_ranks=world_size)``); without those variables it is a single-rank
job on a free local port. Every method is a collective: call it on every rank.

Gradient accumulation is ours, not DeepSpeed's counter: the configured
``gradient_accumulation_steps`` is 1 and each ``train_step`` marks its last micro-batch as
the accumulation boundary, so a step may hold any number of micro-batches. Each loss is
scaled by its global share of the step times the world size (DeepSpeed averages gradients
over ranks), so the update equals the single-process one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from areal_sdk.backends.train.defaults import (
    compile_by_default,
    engine_shares_device,
    micro_batch_tokens_for,
)
from areal_sdk.backends.train.lora import (
    adapter_parameters,
    add_lora,
    merged_tensors,
    save_adapter,
)
from areal_sdk.backends.train.policy import (
    hf_name,
    load_policy,
    merge_metrics,
    plan_buckets,
    read_step_metrics,
)
from areal_sdk.backends.train.torch_backend import (
    META_FILE,
    check_lora_matches,
    model_path_of,
    read_meta,
    use_bf16,
)

from areal_sdk.checkpoints import (
    ADAPTER_DIR,
    OPTIMIZER_DIR,
    SHARD_BYTES,
    ModelFiles,
    write_weights,
)
from areal_sdk.config import TrainConfig
from areal_sdk.train_backend import LossFn, NamedTensors, TrainBackend, loss_weight_of

if TYPE_CHECKING:
    from areal_sdk.config import Config
    from areal_sdk.packing import MicroBatch

# DeepSpeed writes its checkpoint (optimizer shards, fp32 master weights) into
# ``<checkpoint>/<tag>``: under this tag that is the checkpoint's optimizer directory.
CHECKPOINT_TAG = OPTIMIZER_DIR
OLD_CHECKPOINT_TAG = "deepspeed"  # checkpoints of areal-sdk before model directories


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed with the accelerator matching ``device`` (cpu or cuda)."""
    wanted = "cpu" if device.type == "cpu" else "cuda"
    if "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", wanted)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    found = get_accelerator().device_name()
    if found != wanted:
        raise RuntimeError(
            f"DeepSpeed was already set up for {found!r} in this process (DS_ACCELERATOR="
            f"{os.environ.get('DS_ACCELERATOR')!r}), but train.device asks for {wanted!r}; "
            "start a fresh process, or set DS_ACCELERATOR before anything imports deepspeed"
        )
    return deepspeed


def init_distributed(deepspeed: Any, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the job's process group, or start a one-rank one (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        return
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(_free_port())
    env.setdefault("LOCAL_RANK", env["RANK"])
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else int(env["LOCAL_RANK"]))
    deepspeed.init_distributed(
        dist_backend="gloo" if device.type == "cpu" else "nccl",
        auto_mpi_discovery=False,
        timeout=timedelta(seconds=timeout_s),
    )


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def deepspeed_config(cfg: TrainConfig, *, bf16: bool | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON config for ``cfg`` (``train.deepspeed`` merged over it); ``bf16``
    overrides ``cfg.bf16`` (float32 where the device has no native bf16)."""
    base: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": bool(cfg.bf16) if bf16 is None else bf16},
        "zero_optimization": {"stage": cfg.zero_stage},
        # A client torch.optim.AdamW: no op to build; DeepSpeed asks for this flag under ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return _merge(base, cfg.deepspeed)


class DeepSpeedBackend(TrainBackend):
    """A local HF causal LM trained by a DeepSpeed engine, ZeRO stage ``train.zero_stage``."""

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
        self.cfg = train or TrainConfig(backend="deepspeed")
        device = torch.device(self.cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"train.device is {self.cfg.device!r} but CUDA is not available")
        self._ds = import_deepspeed(device)
        init_distributed(self._ds, device)
        self.initial_version = initial_version
        self.model_files = ModelFiles.from_source(model_path, tokenizer_path)
        model = load_policy(
            model_path,
            attn_implementation=self.cfg.attn_implementation,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
            temperature=temperature,
            chunk_size=self.cfg.logprob_chunk_size,
            logprob_backend=self.cfg.logprob_backend,
            padded_attention=self.cfg.padded_attention,
            varlen_kernel=self.cfg.varlen_kernel,
            compile_layers=compile_by_default(self.cfg.compile, device),
        )
        # train.lora: adapters injected into the policy, every other weight frozen (and so
        # outside the optimizer and ZeRO's gradient and optimizer-state partitions).
        self.adapter = add_lora(model.policy, self.cfg.lora) if self.cfg.lora else None
        # From the card's total memory, so that every rank (on like cards) packs alike.
        self.micro_batch_tokens = self.cfg.micro_batch_tokens or micro_batch_tokens_for(
            model,
            device,
            compiled=compile_by_default(self.cfg.compile, device),
            checkpointing=self.cfg.gradient_checkpointing,
            shares_device=shares_device,
            stored_softmax=self.cfg.logprob_backend == "stored",
        )
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=self.cfg.lr,
            betas=tuple(self.cfg.betas),
            eps=self.cfg.eps,
            weight_decay=self.cfg.weight_decay,
        )
        self.engine, self.optimizer, _, _ = self._ds.initialize(
            model=model,
            optimizer=optimizer,
            config=deepspeed_config(self.cfg, bf16=use_bf16(self.cfg.bf16, device)),
            dist_init_required=False,
        )
        self._step = 0

    @classmethod
    def from_config(cls, config: Config) -> DeepSpeedBackend:
        """The factory registered as train backend ``deepspeed``."""
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
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage())

    # -- collectives -----------------------------------------------------------------------

    def _sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return float(t.item())

    @property
    def _comm_device(self) -> torch.device:
        return torch.device("cpu") if dist.get_backend() == "gloo" else self.device

    def _check_same_count(self, n: int) -> None:
        counts: list[int] = [0] * self.world_size
        dist.all_gather_object(counts, n)
        if len(set(counts)) != 1:
            raise ValueError(
                f"every rank must get the same number of micro-batches (got {counts} per rank); "
                "pack with pack_samples(..., num_ranks=world_size)"
            )

    # -- compute ---------------------------------------------------------------------------

    def _run(
        self, batch: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mb = batch.to(self.device)
        return self.engine(
            mb.input_ids, mb.position_ids, mb.cu_seqlens, with_entropy, mb.parents, mb.head_rows
        )

    @torch.no_grad()
    def forward_logprobs(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        self._check_same_count(len(batches))
        self.engine.eval()
        try:
            return [self._run(b, with_entropy=False)[0].float().cpu() for b in batches]
        finally:
            self.engine.train()

    def train_step(self, batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        if not batches:
            raise ValueError("train_step needs at least one micro-batch per rank")
        self._check_same_count(len(batches))
        weights = [loss_weight_of(loss_fn, b) for b in batches]
        total = self._sum(sum(weights))
        world = self.world_size
        lr = float(self.optimizer.param_groups[0]["lr"])
        if total <= 0:
            # Nothing to learn from on any rank (all padding): every rank skips alike.
            return {"loss": 0.0, "grad_norm": 0.0, "lr": lr, "skipped": 1.0, "tokens": 0.0}
        self.engine.train()
        parts: list[tuple[float, Mapping[str, float | torch.Tensor]]] = []
        losses: list[torch.Tensor] = []
        for i, (batch, weight) in enumerate(zip(batches, weights, strict=True)):
            share = weight / total
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            mb = batch.to(self.device)
            logprobs, entropy = self.engine(
                mb.input_ids, mb.position_ids, mb.cu_seqlens, True, mb.parents, mb.head_rows
            )
            loss, metrics = loss_fn(logprobs.float(), entropy, mb)
            self.engine.backward(loss * (share * world), scale_wrt_gas=False)
            self.engine.step()
            losses.append(loss)
            parts.append((share, metrics))
        read, step_loss = read_step_metrics(parts, losses)
        self._step += 1
        grad_norm = self.engine.get_global_grad_norm()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (read, step_loss, sum(b.num_tokens for b in batches)))
        metrics = merge_metrics([p for rank_parts, _, _ in gathered for p in rank_parts])
        metrics.update(
            {
                "loss": sum(g[1] for g in gathered),
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": lr,
                "skipped": 0.0,
                "tokens": float(sum(g[2] for g in gathered)),
            }
        )
        return metrics

    # -- weights out -----------------------------------------------------------------------

    @property
    def trains_adapter(self) -> bool:
        return self.adapter is not None

    def state_for_sync(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The weights under the base model's names; with ``train.lora``, merged with the
        adapters one tensor at a time (the trained weights themselves stay unmerged)."""
        if self.adapter is not None:
            yield from self._merged_for_sync(bucket_bytes)
            return
        named = [(hf_name(n), p) for n, p in self.engine.module.named_parameters()]
        stage3 = self.zero_stage == 3

        def nbytes(p: torch.Tensor) -> int:
            numel = p.ds_numel if stage3 and hasattr(p, "ds_numel") else p.numel()
            return int(numel) * p.element_size()

        for bucket in plan_buckets([nbytes(p) for _, p in named], bucket_bytes):
            if not stage3:
                # ZeRO 0-2 keep whole (bf16 or fp32) weights on every rank.
                yield [(named[i][0], named[i][1].detach()) for i in bucket]
                continue
            params = [named[i][1] for i in bucket]
            # Every rank gathers (a collective); copies outlive the re-partition on exit.
            with torch.no_grad(), self._ds.zero.GatheredParameters(params, modifier_rank=None):
                out = [(named[i][0], named[i][1].detach().clone()) for i in bucket]
            yield out

    def _merged_for_sync(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """``state_for_sync`` under ``train.lora``: each bucket's base weights and adapters
        gathered together under ZeRO-3 (a collective), merged, copied out."""
        merged = merged_tensors(self.engine.module)
        stage3 = self.zero_stage == 3

        def nbytes(p: torch.Tensor) -> int:
            numel = p.ds_numel if stage3 and hasattr(p, "ds_numel") else p.numel()
            return int(numel) * p.element_size()

        for bucket in plan_buckets([nbytes(m.params[0]) for m in merged], bucket_bytes):
            if not stage3:
                yield [(merged[i].name, merged[i].compute()) for i in bucket]
                continue
            params = [p for i in bucket for p in merged[i].params]
            with torch.no_grad(), self._ds.zero.GatheredParameters(params, modifier_rank=None):
                out = [(merged[i].name, merged[i].compute().clone()) for i in bucket]
            yield out

    def save_adapter(self, directory: str | Path) -> Path:
        """The adapter in PEFT's layout (rank 0 writes; a collective under ZeRO-3)."""
        if self.adapter is None:
            raise ValueError("this run trains every weight (train.lora is not set): no adapter")
        directory = Path(directory)
        params = adapter_parameters(self.engine.module) if self.zero_stage == 3 else []
        with self._ds.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            if self.rank == 0:
                save_adapter(self.adapter, directory)
        dist.barrier()
        return directory

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """An HF model directory of the gathered weights (rank 0 writes; in the module's
        dtype, bfloat16 under ``train.bf16``), DeepSpeed's own checkpoint beside it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        buckets = self.state_for_sync(SHARD_BYTES)  # a collective: every rank iterates it
        if self.rank == 0:
            self.model_files.write(directory, write_weights(buckets, directory))
        else:
            for _ in buckets:
                pass
        if self.adapter is not None:
            self.save_adapter(directory / ADAPTER_DIR)
        self.engine.save_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            client_state={"step": self._step},
            save_latest=False,
            # Under train.lora the frozen base is the run's model: DeepSpeed keeps the adapters.
            exclude_frozen_parameters=self.adapter is not None,
        )
        dist.barrier()
        if self.rank == 0:
            meta = {
                "backend": "deepspeed",
                "step": self._step,
                "initial_version": self.initial_version,
                "world_size": self.world_size,
                "zero_stage": self.zero_stage,
                "lora": self.adapter is not None,
            }
            (directory / META_FILE).write_text(json.dumps(meta))
        dist.barrier()

    def load(self, directory: str | Path) -> None:
        directory = Path(directory)
        meta = read_meta(directory, "deepspeed")
        check_lora_matches(meta, self.cfg, directory)
        if meta.get("world_size") != self.world_size and self.zero_stage > 0:
            raise ValueError(
                f"{directory} was saved by {meta.get('world_size')} ranks under ZeRO; "
                f"this job has {self.world_size}: ZeRO optimizer shards must match"
            )
        tag = CHECKPOINT_TAG if (directory / CHECKPOINT_TAG).is_dir() else OLD_CHECKPOINT_TAG
        if not (directory / tag).is_dir():
            raise FileNotFoundError(
                f"{directory} holds the model but no optimizer state to resume from: "
                "run.keep_optimizer_state: latest keeps it in the newest checkpoint only"
            )
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            # Under train.lora the checkpoint holds the adapters alone (the base is as loaded).
            load_module_strict=self.adapter is None,
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {directory}")
        self._step = int(meta["step"])
        self.initial_version = int(meta.get("initial_version", 0))

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
