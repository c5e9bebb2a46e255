"""Buckets of a weight push held aside while the engine keeps generating.

A push without a pause sends its buckets with ``stage_for_version`` (an extension of
SGLang's ``/update_weights_from_tensor``): each one is copied here, off the engine's loop,
and the last bucket (the one naming ``weight_version``) loads them all in one engine command
between two steps. The engine never runs a step on half-new weights and never idles while
the buckets travel; a pause costs it the whole transfer (``benchmarks/README.md``).

>>> stage = WeightStage()
>>> stage.add(7, {"w": tensor})          # a copy: the sender may free its buffer
>>> stage.take(7, expected_buckets=1)    # every staged tensor, the stage emptied
"""

from __future__ import annotations

import torch

# In the refusal of a last bucket whose stage is incomplete: the pusher pushes again.
INCOMPLETE_STAGE = "staged an incomplete push"


class StageError(ValueError):
    """A final bucket whose stage is incomplete (a server that joined mid-push, a lost
    bucket): loading it would mix two versions' weights."""


class WeightStage:
    """Copies of the buckets staged for one version; a bucket for another version drops them
    (the push they belonged to was abandoned)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.buckets = 0
        self._tensors: dict[str, torch.Tensor] = {}

    def add(self, version: int, named: dict[str, torch.Tensor]) -> None:
        if version != self.version:
            self.clear()
            self.version = version
        copies = {name: t.detach().clone() for name, t in named.items()}
        # The sender frees its buffer once this request returns: the copies must be done.
        for device in {t.device for t in copies.values() if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
        self._tensors.update(copies)
        self.buckets += 1

    def take(self, version: int, expected_buckets: int) -> dict[str, torch.Tensor]:
        """The staged tensors of ``version``; raises ``StageError`` unless exactly
        ``expected_buckets`` were staged for it. Empties the stage either way (with
        ``expected_buckets`` 0, a load that staged nothing, it returns nothing)."""
        held, count, tensors = self.version, self.buckets, self._tensors
        self.clear()
        if not expected_buckets:
            return {}
        if held != version or count != expected_buckets:
            raise StageError(
                f"{INCOMPLETE_STAGE}: the push of version {version} staged "
                f"{count if held == version else 0} of {expected_buckets} buckets here"
            )
        return tensors

    def clear(self) -> None:
        self.version, self.buckets, self._tensors = None, 0, {}
