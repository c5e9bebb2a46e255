"""Conversation -> prompt ids, with the model's chat template and token-exact history.

The first call of a conversation is the chat template applied to the request, tokenized. A
later call that repeats an earlier call's conversation plus the reply the gateway returned
(and then adds new messages) is *not* re-tokenized: its prompt is that earlier call's
``prompt_ids + completion_ids`` (the ids the engine really consumed and sampled) followed by
the template's tokens for whatever comes after the reply. So the merged training sequence is
exactly what was generated, with template tokens only where the model did not sample.

The template tokens after the reply are found by rendering the conversation twice (up to the
reply, and in full) and checking that the template is prefix-preserving there; the rendered
reply's end-of-turn marker (``<|im_end|>``) is where the sampled ids take over. When any check
fails the prompt is re-tokenized from the full rendering and the reason is reported, so the
split shows up in metrics instead of passing silently.

Fallback: a tokenizer without a chat template gets ``CHATML_FALLBACK``; a template that
ignores ``tools`` gets the tool signatures in its system message and tool calls and results
as ``<tool_call>``/``<tool_response>`` text, the format the ``hermes`` parser reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from areal_sdk.gateway.conversation import Message, Tool, conversation_key
from areal_sdk.gateway.errors import GatewayError

CHATML_FALLBACK = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions. Signatures:\n<tools>\n{tools}\n</tools>\n"
    'Return each call as <tool_call>{{"name": ..., "arguments": ...}}</tool_call>'
)


@dataclass
class HistoryEntry:
    """What a later call needs to continue an earlier one token-exactly."""

    messages: tuple[tuple[Any, ...], ...]  # conversation_key of the request
    reply: tuple[Any, ...]  # Message.key() of the reply returned to the client
    render_key: str  # tools and template kwargs; history is reused only under the same ones
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class Prompt:
    ids: list[int]
    text: str  # the template's rendering of the full request
    reused: HistoryEntry | None = None
    split_reason: str | None = None  # set when history existed but could not be reused
    template_ids: list[int] = field(default_factory=list)  # tokens added after the reused history


def render_key(tools: list[Tool], template_kwargs: dict[str, Any]) -> str:
    return json.dumps(
        [[t.to_template() for t in tools], template_kwargs], sort_keys=True, default=str
    )


class PromptBuilder:
    """Renders conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template: str = (
            chat_template or getattr(tokenizer, "chat_template", None) or CHATML_FALLBACK
        )
        if isinstance(self.template, dict):  # some tokenizers ship named templates
            self.template = self.template.get("default") or next(iter(self.template.values()))
        self.native_tools = "tools" in self.template
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_ids: set[int] = {eos} if isinstance(eos, int) else set()

    # -- rendering ---------------------------------------------------------------------------

    def _as_text_tools(self, messages: list[Message], tools: list[Tool]) -> list[dict[str, Any]]:
        """Tools and tool traffic as plain text, for templates that do not render tools."""
        out: list[dict[str, Any]] = []
        sigs = "\n".join(json.dumps(t.to_template(), ensure_ascii=False) for t in tools)
        preamble = _TOOLS_PREAMBLE.format(tools=sigs) if tools else ""
        if preamble:
            if messages and messages[0].role == "system":
                out.append({"role": "system", "content": messages[0].content + "\n\n" + preamble})
                messages = messages[1:]
            else:
                out.append({"role": "system", "content": preamble})
        for m in messages:
            if m.role == "assistant" and m.tool_calls:
                calls = "".join(
                    "<tool_call>\n"
                    + json.dumps(
                        {"name": c.name, "arguments": c.arguments_obj()}, ensure_ascii=False
                    )
                    + "\n</tool_call>"
                    for c in m.tool_calls
                )
                out.append({"role": "assistant", "content": m.content + calls})
            elif m.role == "tool":
                out.append(
                    {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
                )
            else:
                out.append({"role": m.role, "content": m.content})
        return out

    def render(
        self,
        messages: list[Message],
        tools: list[Tool],
        *,
        generation: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text. ``generation`` adds the assistant header (or, when the last
        message is the assistant's own prefill, continues it)."""
        if self.native_tools or not tools:
            convo = [m.to_template() for m in messages]
            tool_dicts = [t.to_template() for t in tools] or None
        else:
            convo, tool_dicts = self._as_text_tools(messages, tools), None
        prefill = generation and bool(messages) and messages[-1].role == "assistant"
        try:
            return self.tokenizer.apply_chat_template(
                convo,
                tools=tool_dicts,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation and not prefill,
                continue_final_message=prefill,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja's raise_exception, bad roles: the request's fault
            raise GatewayError(
                400,
                f"the chat template rejected the messages: {exc}",
                param="messages",
                code="invalid_messages",
            ) from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- prompts -------------------------------------------------------------------------------

    def build(
        self,
        messages: list[Message],
        tools: list[Tool],
        history: Iterable[HistoryEntry] = (),
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The prompt ids for a request, reusing sampled ids of the longest matching turn."""
        if not messages:
            raise GatewayError(
                400, "messages must not be empty", param="messages", code="invalid_messages"
            )
        kwargs = template_kwargs or {}
        full = self.render(messages, tools, generation=True, template_kwargs=kwargs)
        rkey = render_key(tools, kwargs)
        keys = conversation_key(messages)
        best: HistoryEntry | None = None
        for entry in history:
            k = len(entry.messages)
            # at least one new message must follow the earlier reply
            if (
                k + 1 < len(keys)
                and entry.render_key == rkey
                and keys[k] == entry.reply
                and keys[:k] == entry.messages
                and (best is None or k > len(best.messages))
            ):
                best = entry
        if best is None:
            return Prompt(ids=self.encode(full), text=full)
        reason, suffix = self._suffix_after(best, messages, tools, kwargs, full)
        if suffix is None:
            return Prompt(ids=self.encode(full), text=full, split_reason=reason)
        template_ids = self.encode(suffix)
        return Prompt(
            ids=[*best.prompt_ids, *best.completion_ids, *template_ids],
            text=full,
            reused=best,
            template_ids=template_ids,
        )

    def _suffix_after(
        self,
        entry: HistoryEntry,
        messages: list[Message],
        tools: list[Tool],
        kwargs: dict[str, Any],
        full: str,
    ) -> tuple[str | None, str | None]:
        """The template text that follows the sampled reply, or (reason, None)."""
        k = len(entry.messages)
        before = self.render(messages[:k], tools, generation=True, template_kwargs=kwargs)
        with_reply = self.render(messages[: k + 1], tools, generation=False, template_kwargs=kwargs)
        if not (with_reply.startswith(before) and full.startswith(with_reply)):
            return "template_not_prefix_preserving", None
        reply_text = with_reply[len(before) :]
        eos_text = self._end_text(entry.completion_ids)
        pos = reply_text.rfind(eos_text) if eos_text else -1
        if pos < 0:
            return "no_end_of_turn_marker", None
        ended = bool(entry.completion_ids) and entry.completion_ids[-1] in self.end_ids
        # The sampled ids already hold the end-of-turn token when the model stopped on it;
        # otherwise (max_tokens, a stop string) the template's marker is added as prompt.
        tail = reply_text[pos + len(eos_text) :] if ended else reply_text[pos:]
        return None, tail + full[len(with_reply) :]

    def _end_text(self, completion_ids: list[int]) -> str | None:
        if completion_ids and completion_ids[-1] in self.end_ids:
            return self.tokenizer.decode([completion_ids[-1]])
        return getattr(self.tokenizer, "eos_token", None)
