"""The part every route shares: prompt -> engine -> decoded, parsed, recorded completions.

Routes only translate wire formats. ``Generator.chat`` takes a conversation in the internal
shape, builds the prompt (reusing sampled history token-exactly), checks the context window,
samples ``n`` completions, splits reasoning and tool calls out of each, and records every
completion as a ``Turn`` of the caller's episode.

A completion that the engine returns with ``finish_reason="abort"`` (weights were being
updated) is resubmitted with its partial output appended, as AReaL's client does, so the
client sees one completion whose ``versions`` show where the weights changed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from areal_sdk.gateway.conversation import Message, Tool, ToolCall, new_call_id
from areal_sdk.gateway.errors import GatewayError, from_validation
from areal_sdk.gateway.metrics import GatewayMetrics
from areal_sdk.gateway.sessions import Session, SessionManager
from areal_sdk.gateway.templating import HistoryEntry, Prompt, PromptBuilder, render_key
from areal_sdk.gateway.tool_parsers import ToolCallParser, parse_completion, reasoning_of
from areal_sdk.inference import GenerateChunk, GenerateOutput, InferenceBackend, SamplingParams
from areal_sdk.trajectory import Turn, TurnApi, new_id

# An engine that keeps aborting (paused for longer than this many resubmissions) fails the call.
MAX_RESUBMITS = 64


@dataclass
class Sampled:
    """One completion, decoded and parsed."""

    output: GenerateOutput
    text: str  # decoded completion, without the end-of-turn token, cut at a stop string
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"  # stop | length | tool_calls
    matched_stop: str | None = None  # the stop string that ended it, if one did
    turn: Turn | None = None

    @property
    def ids(self) -> list[int]:
        return self.output.output_ids

    def reply(self) -> Message:
        return Message(
            role="assistant",
            content=self.content,
            tool_calls=self.tool_calls,
            reasoning=self.reasoning,
        )


@dataclass
class ChatCall:
    """A chat-shaped call after templating: what to sample, and how to record it."""

    session: Session | None
    api: TurnApi
    request: dict[str, Any]
    messages: list[Message]
    tools: list[Tool]
    template_kwargs: dict[str, Any]
    prompt: Prompt
    params: SamplingParams
    parse_tools: bool
    parallel_tool_calls: bool
    metadata: dict[str, Any]  # the client's (x-areal-metadata), merged into each turn's
    turn_ids: list[str]  # one per choice, known before sampling so headers can name them
    thinking: bool = False  # the prompt opened a <think> block


@dataclass
class ChatResult:
    prompt: Prompt
    choices: list[Sampled]


class Generator:
    def __init__(
        self,
        backend: InferenceBackend,
        builder: PromptBuilder,
        parser: ToolCallParser,
        sessions: SessionManager,
        metrics: GatewayMetrics,
        *,
        max_model_len: int,
        default_max_tokens: int,
    ) -> None:
        self.backend = backend
        self.builder = builder
        self.tokenizer = builder.tokenizer
        self.parser = parser
        self.sessions = sessions
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    # -- sampling --------------------------------------------------------------------------

    def sampling(self, prompt_len: int, max_tokens: int | None, **fields: Any) -> SamplingParams:
        """SamplingParams for a request, after checking it fits the context window."""
        room = self.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = max_tokens if max_tokens is not None else 1
            raise GatewayError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + asked} tokens ({prompt_len} in the messages, "
                f"{asked} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="messages",
                code="context_length_exceeded",
            )
        budget = max_tokens if max_tokens is not None else min(self.default_max_tokens, room)
        clean = {k: v for k, v in fields.items() if v is not None}
        try:
            return SamplingParams(max_new_tokens=budget, **clean)
        except ValidationError as exc:
            raise from_validation(exc) from exc

    async def completion_chunks(
        self, prompt_ids: list[int], sampling: SamplingParams, *, live: bool
    ) -> AsyncIterator[GenerateChunk]:
        """One completion's tokens as chunks; the last carries the finished ``GenerateOutput``.

        ``live`` streams from the backend as it samples; otherwise one ``generate`` call per
        submission. An aborted submission (weights being updated) is resubmitted with its
        partial output appended; the chunks continue seamlessly.
        """
        acc = GenerateOutput(output_ids=[], logprobs=[], versions=[], finish_reason="stop")
        wants_top = sampling.top_logprobs_num > 0
        tops: list[list[tuple[int, float]]] = []
        for attempt in range(MAX_RESUBMITS):
            left = sampling.max_new_tokens - len(acc.output_ids)
            part = sampling.model_copy(update={"max_new_tokens": left})
            ids = [*prompt_ids, *acc.output_ids]
            source = (
                self.backend.stream(ids, part) if live else _once(self.backend.generate(ids, part))
            )
            async for chunk in _guarded(source):
                out = chunk.output
                if out is None:
                    yield chunk
                    continue
                acc.output_ids += out.output_ids
                acc.logprobs += out.logprobs
                acc.versions += out.versions
                tops += out.top_logprobs or []
                for k, v in out.meta.items():
                    if isinstance(v, list) and isinstance(acc.meta.get(k), list):
                        acc.meta[k] = acc.meta[k] + v
                    else:
                        acc.meta[k] = v
                done = (
                    out.finish_reason != "abort"
                    or len(acc.output_ids) >= sampling.max_new_tokens
                    or attempt == MAX_RESUBMITS - 1
                )
                final = None
                if done:
                    final = GenerateOutput(
                        output_ids=acc.output_ids,
                        logprobs=acc.logprobs,
                        versions=acc.versions,
                        finish_reason="length"
                        if out.finish_reason == "abort"
                        else out.finish_reason,
                        matched_stop=out.matched_stop,
                        prompt_tokens=len(prompt_ids),
                        request_id=out.request_id,
                        meta=acc.meta,
                        top_logprobs=tops if wants_top else None,
                    )
                yield GenerateChunk(
                    ids=chunk.ids,
                    logprobs=chunk.logprobs,
                    versions=chunk.versions,
                    top_logprobs=chunk.top_logprobs,
                    output=final,
                )
                if done:
                    return
                if not out.output_ids:
                    await asyncio.sleep(0.05)  # paused engine: give the weight update time

    async def _generate_one(
        self, prompt_ids: list[int], sampling: SamplingParams
    ) -> GenerateOutput:
        async for chunk in self.completion_chunks(prompt_ids, sampling, live=False):
            if chunk.output is not None:
                return chunk.output
        raise AssertionError("a completion ended without its output")

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams
    ) -> list[GenerateOutput]:
        if sampling.n == 1:
            return [await self._generate_one(prompt_ids, sampling)]
        one = sampling.model_copy(update={"n": 1})
        return list(
            await asyncio.gather(
                *(
                    self._generate_one(
                        prompt_ids,
                        one.model_copy(update={"seed": None if one.seed is None else one.seed + i}),
                    )
                    for i in range(sampling.n)
                )
            )
        )

    # -- decoding --------------------------------------------------------------------------

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """The tokens that end a completion: the model's end of turn and the request's own."""
        return self.builder.end_ids | set(params.stop_token_ids)

    def decode(self, output: GenerateOutput, stops: list[str]) -> tuple[str, str | None]:
        """The completion's text as the client sees it, and the stop string that ended it."""
        ids = output.output_ids
        # The token the engine stopped on is not text (OpenAI and Anthropic never show it).
        stopped_on = output.matched_stop if isinstance(output.matched_stop, int) else None
        if ids and (ids[-1] in self.builder.end_ids or ids[-1] == stopped_on):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        matched: str | None = None
        cut = len(text)
        for stop in stops:  # OpenAI and Anthropic both exclude the stop string
            pos = text.find(stop)
            if 0 <= pos < cut:
                cut, matched = pos, stop
        if isinstance(output.matched_stop, str) and output.matched_stop in stops:
            matched = matched or output.matched_stop
        return text[:cut], matched

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def finish(
        self,
        output: GenerateOutput,
        stops: list[str],
        *,
        parse_tools: bool,
        parallel_tool_calls: bool = True,
        thinking: bool = False,
        tools: list[Tool] | None = None,
    ) -> Sampled:
        """Decode and parse a completion; ``thinking``: the prompt opened a ``<think>``;
        ``tools``: the request's, for parsers that type arguments by their schemas."""
        text, matched = self.decode(output, stops)
        split = reasoning_of(self.parser, text, opened=thinking)
        content, calls = split.content, []
        if parse_tools:
            parsed = parse_completion(self.parser, content, tools or [])
            content = parsed.content
            calls = [
                ToolCall(id=new_call_id(), name=c.name, arguments=c.arguments)
                for c in parsed.tool_calls
            ]
            if not parallel_tool_calls:
                calls = calls[:1]
        if calls:
            reason = "tool_calls"
        elif output.finish_reason == "length":
            reason = "length"
        else:
            reason = "stop"
        return Sampled(
            output=output,
            text=text,
            content=content,
            reasoning=split.reasoning,
            tool_calls=calls,
            finish_reason=reason,
            matched_stop=matched,
        )

    # -- recording -------------------------------------------------------------------------

    def make_turn(
        self,
        api: TurnApi,
        request: dict[str, Any],
        prompt_ids: list[int],
        output: GenerateOutput,
        finish_reason: str,
        metadata: dict[str, Any],
        turn_id: str | None = None,
    ) -> Turn:
        return Turn(
            id=turn_id or new_id("turn"),
            api=api,
            request=request,
            prompt_ids=list(prompt_ids),
            completion_ids=list(output.output_ids),
            logprobs=list(output.logprobs),
            versions=list(output.versions),
            finish_reason=finish_reason,
            metadata=metadata,
        )

    def count_tokens(self, prompt_len: int, outputs: list[GenerateOutput]) -> None:
        self.metrics.tokens.labels("prompt").inc(prompt_len)
        self.metrics.tokens.labels("completion").inc(sum(len(o.output_ids) for o in outputs))

    # -- the chat-shaped call (chat completions, responses, messages) -----------------------

    def prepare(
        self,
        session: Session | None,
        api: TurnApi,
        request: dict[str, Any],
        messages: list[Message],
        tools: list[Tool],
        *,
        max_tokens: int | None,
        sampling: dict[str, Any],
        parse_tools: bool,
        parallel_tool_calls: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> ChatCall:
        """Template the conversation (reusing sampled history) and check it fits."""
        kwargs = template_kwargs or {}
        history = session.history if session is not None else ()
        prompt = self.builder.build(messages, tools, history, kwargs)
        if prompt.reused is not None:
            self.metrics.history_merges.inc()
        elif prompt.split_reason is not None:
            self.metrics.history_splits.labels(prompt.split_reason).inc()
        params = self.sampling(len(prompt.ids), max_tokens, **sampling)
        return ChatCall(
            session=session,
            api=api,
            request=request,
            messages=messages,
            tools=tools,
            template_kwargs=kwargs,
            prompt=prompt,
            params=params,
            parse_tools=parse_tools,
            parallel_tool_calls=parallel_tool_calls,
            metadata=dict(metadata or {}),
            turn_ids=[new_id("turn") for _ in range(params.n)],
            thinking=self.opens_thinking(prompt.ids),
        )

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside an open ``<think>`` block (Qwen3-style templates)."""
        tail = self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith("<think>")

    def finish_choice(self, call: ChatCall, output: GenerateOutput) -> Sampled:
        return self.finish(
            output,
            call.params.stop,
            parse_tools=call.parse_tools,
            parallel_tool_calls=call.parallel_tool_calls,
            thinking=call.thinking,
            tools=call.tools,
        )

    def record_choice(
        self, call: ChatCall, index: int, choice: Sampled, *, finish_reason: str | None = None
    ) -> None:
        """Store one completion as a Turn of the call's episode (nothing without a session).

        ``finish_reason="abort"`` records a stream the client left early: the turn holds what
        was sampled, and it is not offered as history for later calls to continue.
        """
        session = call.session
        if session is None:
            return
        source = "merged" if call.prompt.reused else (call.prompt.split_reason or "templated")
        # The client's metadata first, so it cannot overwrite what the gateway records.
        meta: dict[str, Any] = {**call.metadata, "choice": index, "prompt_source": source}
        if choice.reasoning is not None:
            meta["reasoning"] = choice.reasoning
        if choice.tool_calls:
            meta["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": json.loads(c.arguments)}
                for c in choice.tool_calls
            ]
        reason = finish_reason or choice.finish_reason
        turn = self.make_turn(
            call.api,
            call.request,
            call.prompt.ids,
            choice.output,
            reason,
            meta,
            call.turn_ids[index],
        )
        entry = None
        if reason != "abort":
            entry = HistoryEntry(
                messages=tuple(m.key() for m in call.messages),
                reply=choice.reply().key(),
                render_key=render_key(call.tools, call.template_kwargs),
                prompt_ids=call.prompt.ids,
                completion_ids=choice.output.output_ids,
            )
        self.sessions.record(session, turn, entry)
        choice.turn = turn

    async def chat(
        self,
        session: Session | None,
        api: TurnApi,
        request: dict[str, Any],
        messages: list[Message],
        tools: list[Tool],
        **options: Any,
    ) -> ChatResult:
        """Sample a chat-shaped call whole (options as for ``prepare``) and record it."""
        call = self.prepare(session, api, request, messages, tools, **options)
        outputs = await self.generate(call.prompt.ids, call.params)
        self.count_tokens(len(call.prompt.ids), outputs)
        choices = [self.finish_choice(call, o) for o in outputs]
        for i, choice in enumerate(choices):
            self.record_choice(call, i, choice)
        return ChatResult(prompt=call.prompt, choices=choices)


async def _once(result: Awaitable[GenerateOutput]) -> AsyncIterator[GenerateChunk]:
    """A whole ``generate`` result as the single chunk of a stream."""
    out = await result
    yield GenerateChunk(out.output_ids, out.logprobs, out.versions, out.top_logprobs, out)


async def _guarded(source: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
    """The backend's chunks, with its failures turned into client-facing errors."""
    try:
        while True:
            try:
                chunk = await anext(source)
            except StopAsyncIteration:
                return
            except GatewayError:
                raise
            except ValueError as exc:  # the engine's own input checks (EngineInputError)
                raise GatewayError(
                    400,
                    f"the inference engine refused the request: {exc}"[:500],
                    code="invalid_request",
                ) from exc
            except Exception as exc:  # engine down or refused: 503, no trace to the client
                raise GatewayError(
                    503,
                    f"the inference engine is unavailable ({type(exc).__name__}: {exc})"[:500],
                    code="engine_unavailable",
                ) from exc
            yield chunk
    finally:
        await source.aclose()  # type: ignore[attr-defined]
