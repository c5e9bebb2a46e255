"""Live streaming: a chat-shaped call's text, reasoning and tokens as the engine samples them.

``ChatStream`` runs each choice's completion through ``InferenceBackend.stream`` and turns the
growing token sequence into text deltas. Text is held back while it could still change:
a partial stop string, an unfinished UTF-8 character, trailing whitespace, a partial
``<think>``/``</think>`` tag, and anything from where a tool call may begin (the parser's
``live_cut``). When a completion ends, its final reading (``Generator.finish``, the same as
without streaming) supplies whatever was held back, so the deltas add up to exactly the
non-streamed content, and the turn is recorded with the sampled ids. A stream the client
leaves early is recorded with what was sampled so far and ``finish_reason="abort"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_sdk.gateway.tool_parsers import ToolCallParser
from areal_sdk.gateway.tool_parsers.base import partial_suffix
from areal_sdk.inference import GenerateOutput

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from areal_sdk.gateway.generation import ChatCall, Generator, Sampled

log = logging.getLogger("areal_sdk.gateway")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def live_cut(parser: ToolCallParser, text: str) -> int:
    """How much of ``text`` is safe to show as content while tool calls are parsed.

    A parser may say so itself (a ``live_cut(text) -> int`` attribute); an unknown parser
    shows nothing until the completion ends.
    """
    cut = getattr(parser, "live_cut", None)
    return cut(text) if callable(cut) else 0


@dataclass
class LiveText:
    """The visible part of one completion, growing as tokens arrive."""

    gen: Generator
    stops: list[str]
    stop_ids: set[int]  # tokens that end the completion: never text (``Generator.decode``)
    parse_tools: bool
    thinking: bool  # the prompt opened a <think> block for the model
    ids: list[int] = field(default_factory=list)
    reasoning: str = ""  # shown so far
    content: str = ""

    def _visible(self) -> str:
        # A stop token ends the completion, so only the last id can be one; it is held back
        # until a later token shows that it did not end it (``ignore_eos``).
        ids = self.ids[:-1] if self.ids and self.ids[-1] in self.stop_ids else self.ids
        text = self.gen.tokenizer.decode(ids, skip_special_tokens=False)
        text = text.rstrip("\ufffd")  # an unfinished UTF-8 character
        cut = len(text)
        for stop in self.stops:
            pos = text.find(stop)
            if 0 <= pos < cut:
                cut = pos
        if cut < len(text):
            return text[:cut]
        return text[: len(text) - partial_suffix(text, *self.stops)]

    def _split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that are safe to show, as ``split_reasoning`` would read them."""
        own = getattr(self.gen.parser, "split_reasoning", None)
        if callable(own):  # the parser reads reasoning itself (gpt-oss's channels)
            split = own(text)
            return (split.reasoning or "").strip(), self._content(split.content)
        head = text.lstrip()
        if not self.thinking:
            if head.startswith(THINK_OPEN):
                text = head[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(head):  # maybe the start of a <think> tag
                return "", ""
            else:
                return "", self._content(text)
        end = text.find(THINK_CLOSE)
        if end < 0:
            keep = text[: len(text) - partial_suffix(text, THINK_CLOSE)]
            return keep.strip(), ""
        return text[:end].strip(), self._content(text[end + len(THINK_CLOSE) :].lstrip())

    def _content(self, text: str) -> str:
        if self.parse_tools:
            text = text[: live_cut(self.gen.parser, text)]
        return text.rstrip()

    def feed(self, ids: list[int]) -> tuple[str, str]:
        """Add sampled tokens; return the (reasoning, content) text they reveal."""
        self.ids += ids
        reasoning, content = self._split(self._visible())
        return self._grow(reasoning, content)

    def finish(self, final: Sampled) -> tuple[str, str]:
        """The rest of the final reading of the completion."""
        deltas = self._grow(final.reasoning or "", final.content)
        if self.reasoning != (final.reasoning or "") or self.content != final.content:
            log.warning("streamed text diverged from the completion's final reading")
        return deltas

    def _grow(self, reasoning: str, content: str) -> tuple[str, str]:
        r = c = ""
        if reasoning.startswith(self.reasoning) and not self.content:
            r, self.reasoning = reasoning[len(self.reasoning) :], reasoning
        if content.startswith(self.content):
            c, self.content = content[len(self.content) :], content
        return r, c


@dataclass
class ChoiceEvent:
    """What one choice revealed: text deltas, the tokens that arrived, and its end."""

    index: int
    reasoning: str = ""
    content: str = ""
    # Tokens for per-token logprobs (the final end-of-turn token left out, as without streaming).
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    done: Sampled | None = None


class ChatStream:
    """One streamed chat-shaped call. ``await start()``, iterate ``events()``, then ``close()``.

    ``start`` waits for the first tokens, so a request the engine refuses still gets an
    ordinary error response. ``close`` (always called, also when the client went away)
    stops what is still sampling and records it.
    """

    def __init__(self, gen: Generator, call: ChatCall) -> None:
        self.gen = gen
        self.call = call
        n = call.params.n
        stop_ids = gen.stop_ids(call.params)
        self.texts = [
            LiveText(gen, call.params.stop, stop_ids, call.parse_tools, call.thinking)
            for _ in range(n)
        ]
        self.sampled: list[GenerateOutput] = [
            GenerateOutput(output_ids=[], logprobs=[], versions=[], finish_reason="abort")
            for _ in range(n)
        ]
        self.choices: list[Sampled | None] = [None] * n
        self._queue: asyncio.Queue[ChoiceEvent | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._first: ChoiceEvent | None = None
        self._closed = False

    async def start(self) -> None:
        call = self.call
        if call.session is not None:
            self.gen.sessions.begin_call(call.session)
        one = call.params.model_copy(update={"n": 1})
        for i in range(call.params.n):
            seed = None if one.seed is None else one.seed + i
            params = one.model_copy(update={"seed": seed})
            self._tasks.append(asyncio.create_task(self._pump(i, params)))
        first = await self._queue.get()
        if isinstance(first, BaseException):
            await self.close()
            raise first
        self._first = first

    async def _pump(self, index: int, params: Any) -> None:
        gen, text, sampled = self.gen, self.texts[index], self.sampled[index]
        try:
            async for chunk in gen.completion_chunks(self.call.prompt.ids, params, live=True):
                sampled.output_ids += chunk.ids
                sampled.logprobs += chunk.logprobs
                sampled.versions += chunk.versions
                ids, lps, tops = chunk.ids, chunk.logprobs, chunk.top_logprobs
                if chunk.output is not None and ids and ids[-1] in gen.builder.end_ids:
                    ids, lps, tops = ids[:-1], lps[:-1], None if tops is None else tops[:-1]
                reasoning, content = text.feed(chunk.ids)
                event = ChoiceEvent(index, reasoning, content, ids, lps, tops)
                if chunk.output is not None:
                    final = gen.finish_choice(self.call, chunk.output)
                    more_r, more_c = text.finish(final)
                    event.reasoning += more_r
                    event.content += more_c
                    gen.count_tokens(0, [chunk.output])
                    gen.record_choice(self.call, index, final)
                    self.choices[index] = event.done = final
                await self._queue.put(event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._queue.put(exc)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Events of all choices as they come; raises a choice's error (a ``GatewayError``)."""
        assert self._first is not None, "start() first"
        event: ChoiceEvent | BaseException = self._first
        left = len(self.choices)
        while True:
            if isinstance(event, BaseException):
                raise event
            yield event
            if event.done is not None:
                left -= 1
                if left == 0:
                    return
            event = await self._queue.get()

    async def close(self) -> None:
        """Stop unfinished choices, record what they sampled (``abort``), end the call."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        call = self.call
        self.gen.metrics.tokens.labels("prompt").inc(len(call.prompt.ids))
        for i, choice in enumerate(self.choices):
            if choice is not None or not self.sampled[i].output_ids:
                continue  # finished and recorded, or nothing sampled to record
            partial = self.gen.finish_choice(call, self.sampled[i])
            self.gen.count_tokens(0, [self.sampled[i]])
            self.gen.record_choice(call, i, partial, finish_reason="abort")
        if call.session is not None:
            self.gen.sessions.end_call(call.session)

    @property
    def prompt_len(self) -> int:
        return len(self.call.prompt.ids)
