"""The inference-backend interface: token ids in, token ids, logprobs and versions out.

Implementations live in ``areal_sdk.backends`` (the embedded engine, the SGLang client) and
are registered by name through the ``areal_inference_backends`` hook. The gateway and the
rollout controller only ever talk to this interface.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(BaseModel):
    """How to sample one request. Field names follow SGLang's ``sampling_params``."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = Field(1, ge=1)
    # The k most likely tokens at each sampled position (SGLang takes ``top_logprobs_num``
    # beside ``sampling_params``). 0 computes nothing extra.
    top_logprobs_num: int = Field(0, ge=0, le=20)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("top_k")
    @classmethod
    def _top_k_valid(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return value


@dataclass
class GenerateOutput:
    """What one sampled completion returns. Lists are aligned with ``output_ids``."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    # The stop string or token that ended generation, if any.
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    request_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # With ``top_logprobs_num`` k > 0: per position, the k most likely (token id, logprob)
    # pairs, best first, from the distribution the sampled token's logprob comes from.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerateChunk:
    """Tokens that one completion produced since the previous chunk (``InferenceBackend.stream``).

    The last chunk of a completion carries its whole ``output``; the ``ids`` of all chunks
    concatenated equal ``output.output_ids``.
    """

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    output: GenerateOutput | None = None


class PauseMode(StrEnum):
    """SGLang's ``/pause_generation`` modes."""

    ABORT = "abort"  # in-flight requests return their partial output with finish_reason "abort"
    IN_PLACE = "in_place"  # in-flight requests stay, and continue after resume()
    RETRACT = "retract"  # in-flight requests are set aside, their KV dropped, re-run on resume()


WeightSource = Mapping[str, torch.Tensor] | Path | str


class InferenceBackend(abc.ABC):
    """A policy model that serves many generation requests at once.

    ``generate`` may be awaited concurrently from many tasks. ``update_weights`` is applied
    between decoding steps; every token sampled after it carries the new version.
    """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weight version that the next sampled token will carry."""

    @abc.abstractmethod
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> GenerateOutput:
        """Sample one completion of ``input_ids``. ``sampling.n`` must be 1 here;
        callers that want ``n`` completions call ``generate_n``."""

    async def generate_n(
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> list[GenerateOutput]:
        """``sampling.n`` independent completions of the same prompt."""
        import asyncio

        one = sampling.model_copy(update={"n": 1})
        seeds = [None if one.seed is None else one.seed + i for i in range(sampling.n)]
        return list(
            await asyncio.gather(
                *(
                    self.generate(
                        input_ids,
                        one.model_copy(update={"seed": seed}),
                        request_id=None if request_id is None else f"{request_id}-{i}",
                    )
                    for i, seed in enumerate(seeds)
                )
            )
        )

    async def stream(
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Yield one completion's tokens as they are sampled; the last chunk carries the
        ``GenerateOutput``. Leaving the iterator early aborts the request.

        The default waits for ``generate`` and yields everything as one chunk; backends that
        can do better override it.
        """
        out = await self.generate(input_ids, sampling, request_id=request_id)
        yield GenerateChunk(
            ids=list(out.output_ids),
            logprobs=list(out.logprobs),
            versions=list(out.versions),
            top_logprobs=None if out.top_logprobs is None else list(out.top_logprobs),
            output=out,
        )

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Stop scheduling new decoding steps (see ``PauseMode``)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after ``pause``."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End one request now; it returns its partial output with finish_reason "abort"."""

    @abc.abstractmethod
    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Load new weights (named tensors, or a safetensors directory) as ``version``."""

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]:
        """A small status dict; raises if the backend cannot serve."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most backends need nothing
        """Release resources. Safe to call twice."""

    # The tokenizer that produced and decodes the ids; the gateway templates with it.
    tokenizer: Any = None
    model_name: str = "policy"
