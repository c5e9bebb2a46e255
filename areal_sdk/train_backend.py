"""The train-backend interface: packed micro-batches in, logprobs and one optimizer step out.

Implementations live in ``areal_sdk.backends.train`` (``torch``: one process, CPU or GPU;
``deepspeed``: ZeRO 0-3) and are registered by name through the ``areal_train_backends``
hook. The trainer loop and the weight-sync methods only ever talk to this interface.

Loss scaling. ``train_step`` takes one optimizer step over all the micro-batches it is
given, accumulating gradients. Each micro-batch's loss is weighted by its share of the
whole step, so the update does not depend on how the samples were split into micro-batches
(or across ranks). The share is ``weight(batch) / sum(weight(b) for every b in the step)``,
where ``weight`` is ``loss_fn.weight`` when the loss function has that method (the units its
loss is a mean over: tokens, or sequences; see ``areal_sdk.algorithms.losses.PPOLossFn``)
and the number of loss tokens (``batch.loss_mask.sum()``) otherwise.

>>> backend = get_host().train_backend("torch")(config)          # doctest: +SKIP
>>> metrics = backend.train_step(micro_batches, loss_fn)          # doctest: +SKIP
>>> for bucket in backend.state_for_sync(256 << 20):              # doctest: +SKIP
...     engine_side.load(bucket)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from areal_sdk.packing import MicroBatch

# loss_fn(logprobs [N], entropy [N] | None, batch) -> (scalar loss, metrics)
# Metric values may be 0-d tensors: a backend reads them once per step (``metric_values``),
# so the host never waits for the device between a micro-batch's forward and backward.
LossFn = Callable[
    [torch.Tensor, "torch.Tensor | None", "MicroBatch"],
    tuple[torch.Tensor, Mapping[str, "float | torch.Tensor"]],
]
NamedTensors = list[tuple[str, torch.Tensor]]


def loss_weight_of(loss_fn: LossFn, batch: MicroBatch) -> float:
    """A micro-batch's weight in its step: ``loss_fn.weight(batch)``, else its loss tokens."""
    custom = getattr(loss_fn, "weight", None)
    if custom is not None:
        return float(custom(batch))
    return float(batch.loss_mask.sum().item())


class TrainBackend(abc.ABC):
    """A policy under training.

    ``step`` counts optimizer steps taken; ``version`` is the weight version those weights
    carry (``initial_version + step``), the number the engine tags sampled tokens with after
    a sync. Multi-rank backends call every method on every rank (collectives inside);
    ``rank`` 0 is the one that talks to the engine.
    """

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Optimizer steps taken since the start of training (restored by ``load``)."""

    @property
    def version(self) -> int:
        """The weight version of the current weights."""
        return self.initial_version + self.step

    initial_version: int = 0
    # Tokens per packed micro-batch: ``train.micro_batch_tokens``, or what the backend chose
    # for its device when that is unset.
    micro_batch_tokens: int = 8192

    @property
    def rank(self) -> int:
        """This process's rank among the trainer's ranks."""
        return 0

    @property
    def world_size(self) -> int:
        """How many trainer ranks share this model."""
        return 1

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the model lives."""

    @abc.abstractmethod
    def forward_logprobs(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Current-policy logprobs, no grad: one float32 ``[N]`` tensor per micro-batch.

        Aligned like ``input_ids`` (value t is the logprob of token t given tokens < t of
        its sequence; 0 at each sequence's first token). Returned on the CPU.
        """

    @abc.abstractmethod
    def train_step(self, batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batches`` (gradient accumulation, clipping).

        Returns the step's metrics: ``loss`` (the weighted step loss), ``grad_norm`` (before
        clipping), ``lr``, ``tokens``, and the loss function's metrics averaged with the same
        weights as the loss.
        """

    @abc.abstractmethod
    def state_for_sync(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The weights in HF naming, one bucket of about ``bucket_bytes`` at a time.

        Under ZeRO-3 each bucket is gathered when it is requested and released after, so
        peak extra memory is one bucket. A bucket's tensors are valid until the next bucket
        is requested: copy what must outlive that. Every rank must iterate to the end.
        """

    @abc.abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write model, optimizer and step into ``directory`` (created if needed): the model
        as a Hugging Face directory that ``from_pretrained`` loads, the optimizer state in
        ``directory/optimizer`` (the layout is ``areal_sdk.checkpoints``'s)."""

    @abc.abstractmethod
    def load(self, directory: str | Path) -> None:
        """Restore what ``save`` wrote; training continues exactly where it stopped."""

    @property
    def trains_adapter(self) -> bool:
        """Whether only LoRA adapters train (``train.lora``): ``save_adapter`` then writes
        them, for engines that load adapters rather than whole weights."""
        return False

    def save_adapter(self, directory: str | Path) -> Path:
        """Write the trained LoRA adapter in PEFT's layout (``adapter_config.json``,
        ``adapter_model.safetensors``) into ``directory``; rank 0 writes, every rank calls."""
        raise ValueError(f"{type(self).__name__} trains every weight: it has no adapter")

    def close(self) -> None:  # noqa: B027 - optional hook, most backends need nothing
        """Release resources (process groups, GPU memory). Safe to call twice."""
