"""One generation request's state inside the engine, and its stop conditions."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from areal_sdk.inference import FinishReason, GenerateChunk, GenerateOutput, SamplingParams

TopLogprobs = list[tuple[int, float]]


@dataclass
class StreamChunk(GenerateChunk):
    """Tokens a request produced in one step; ``output`` is set on the last chunk."""

    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    """A request from admission to finish. Owned by the engine thread once submitted."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None  # None: the device RNG (not reproducible)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[StreamChunk]
    stop_ids: frozenset[int]
    # Streaming requests get a chunk every step; the others only their final output.
    streaming: bool = True
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # Only filled when sampling.top_logprobs_num > 0.
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    slot: int | None = None
    # Tokens of prompt_ids + output_ids whose keys/values are in the slot's cache.
    num_computed: int = 0
    # The weights epoch of those keys/values (prefix_reuse: only the current one is reused).
    kv_epoch: int = 0
    # Waiting for an active request's prefill to cover this many of its tokens, to copy them.
    reuse_from: Request | None = None
    reuse_len: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    # Tokens produced since the last chunk was delivered.
    pending_from: int = 0

    @cached_property
    def temperature_only(self) -> bool:
        """Sampling sets nothing but a temperature (no truncation, seed or top logprobs),
        so a decode graph can sample this request's tokens."""
        s = self.sampling
        truncates = s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0
        return self.seed is None and s.top_logprobs_num == 0 and not truncates

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens(self) -> list[int]:
        """``prompt_ids`` then ``output_ids``."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.seq_len - self.num_computed

    def append(
        self,
        token: int,
        logprob: float,
        version: int,
        tokenizer: Any,
        top: TopLogprobs | None = None,
    ) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.top_logprobs.append(top)
        self.num_computed = self.seq_len - 1
        s = self.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.stop_ids):
            self.finish("stop", token)
        elif s.stop and tokenizer is not None and (hit := self._stop_string(tokenizer)) is not None:
            self.finish("stop", hit)
        elif len(self.output_ids) >= s.max_new_tokens:
            self.finish("length")

    def _stop_string(self, tokenizer: Any) -> str | None:
        # A stop string of L characters is spread over at most L + 2 byte-level tokens.
        window = max(len(x) for x in self.sampling.stop) + 2
        tail = tokenizer.decode(self.output_ids[-window:], skip_special_tokens=False)
        for stop in self.sampling.stop:
            if stop and stop in tail:
                return stop
        return None

    def finish(self, reason: FinishReason, matched: str | int | None = None) -> None:
        self.finish_reason = reason
        self.matched_stop = matched

    def take_chunk(self) -> StreamChunk:
        """The tokens produced since the last chunk, with the final output when finished."""
        start = self.pending_from
        self.pending_from = len(self.output_ids)
        wants_top = self.sampling.top_logprobs_num > 0
        chunk = StreamChunk(
            ids=self.output_ids[start:],
            logprobs=self.logprobs[start:],
            versions=self.versions[start:],
            top_logprobs=self.top_logprobs[start:] if wants_top else None,
        )
        if self.finish_reason is not None:
            chunk.output = GenerateOutput(
                output_ids=list(self.output_ids),
                logprobs=list(self.logprobs),
                versions=list(self.versions),
                finish_reason=self.finish_reason,
                matched_stop=self.matched_stop,
                prompt_tokens=len(self.prompt_ids),
                request_id=self.rid,
                top_logprobs=list(self.top_logprobs) if wants_top else None,
                meta={
                    "retractions": self.retractions,
                    "e2e_latency": time.monotonic() - self.created,
                },
            )
        return chunk
