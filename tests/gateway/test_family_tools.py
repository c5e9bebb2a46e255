"""Tool round trips in five model families' formats (Llama 3.x JSON, Mistral, DeepSeek-V3,
Qwen3-Coder, gpt-oss harmony), through a real gateway and engine and the official SDKs.

One tiny model is fitted to every family's conversation (``family_model.py``); each gateway
gets that family's tokenizer and picks its parser from the chat template. Per family and
route, streamed and not: the calls come back as ``tool_calls`` / ``tool_use`` with their JSON
arguments, gpt-oss's analysis channel as reasoning, the answer after the tool results as
text (streamed deltas adding up to it), and the second prompt, rendered from the client's
messages, extends the first prompt + sampled calls token-exactly (one merged sample).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import pytest
from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig
from openai import OpenAI

from areal_sdk.gateway import create_app
from areal_sdk.samples import MergeStats, build_samples
from areal_sdk.server_thread import ServerThread
from areal_sdk.store import TrajectoryStore
from tests.gateway.conftest import ADMIN, Gateway, gateway_host
from tests.gateway.family_model import family_tokenizer, fit_family_model
from tests.gateway.family_templates import ANTHROPIC_TOOLS, FAMILIES, OPENAI_TOOLS, Family

# The first test also fits the model (about a minute on two busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def family_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_family_model(tiny_model_dir, tmp_path_factory.mktemp("family-model"))


@pytest.fixture(scope="module")
def family_engine(family_dir: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine.from_pretrained(
        str(family_dir), config=EngineConfig(max_batch_size=4, max_model_len=1024)
    )
    yield eng
    import asyncio

    asyncio.run(eng.close())


def serve_family(
    engine: EmbeddedEngine, model_dir: Path, family: Family, tmp_path: Path, **kwargs: object
) -> Iterator[tuple[Family, Gateway, object]]:
    tok = family_tokenizer(model_dir, family)
    store = TrajectoryStore(tmp_path / "store")
    app = create_app(
        engine,
        tok,
        admin_token=ADMIN,
        episode_sink=store,
        host=gateway_host(),
        max_model_len=1024,
        default_max_tokens=160,
        **kwargs,
    )
    with ServerThread(app, name="gateway") as server:
        yield family, Gateway(server.url, ADMIN, store, app), tok
    store.close()


@pytest.fixture(params=FAMILIES, ids=lambda f: f.parser)
def family_gateway(
    request: pytest.FixtureRequest, family_engine: EmbeddedEngine, family_dir: Path, tmp_path: Path
) -> Iterator[tuple[Family, Gateway, object]]:
    yield from serve_family(family_engine, family_dir, request.param, tmp_path)


@dataclass
class Reply:
    content: str = ""
    reasoning: str | None = None
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # id, name, arguments
    stop: str | None = None

    def call_args(self) -> list[tuple[str, dict]]:
        return [(name, json.loads(args)) for _, name, args in self.calls]


def check_merged(gw: Gateway, episode_id: str, tok, family: Family) -> None:
    assert gw.end(episode_id, reward=1.0).status_code == 200
    episode = gw.store.get(episode_id)
    t1, t2 = episode.turns
    sampled = [tok.decode(t.completion_ids, skip_special_tokens=False) for t in (t1, t2)]
    assert sampled == [family.call_text + family.call_end, family.answer_text + family.eos]
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.completion_ids)] == [
        *t1.prompt_ids,
        *t1.completion_ids,
    ]
    assert t2.metadata["prompt_source"] == "merged"
    stats = MergeStats()
    [sample] = build_samples(episode, stats=stats)
    assert stats.merged == 1
    assert sample.input_ids == [*t2.prompt_ids, *t2.completion_ids]
    assert sum(sample.loss_mask) == len(t1.completion_ids) + len(t2.completion_ids)


def openai_reply(client: OpenAI, messages: list[dict], stream: bool) -> Reply:
    kwargs = {"model": "gpt-4o", "messages": messages, "tools": OPENAI_TOOLS, **GREEDY}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        return Reply(
            content=message.content or "",
            reasoning=getattr(message, "reasoning_content", None),
            calls=[(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []],
            stop=choice.finish_reason,
        )
    reply = Reply()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reply.content += delta.content or ""
        if getattr(delta, "reasoning_content", None):
            reply.reasoning = (reply.reasoning or "") + delta.reasoning_content
        for c in delta.tool_calls or []:
            reply.calls.append((c.id, c.function.name, c.function.arguments))
        reply.stop = chunk.choices[0].finish_reason or reply.stop
    return reply


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_chat_tool_round_trip(family_gateway, stream):
    family, gw, tok = family_gateway
    episode_id, key = gw.open_session()
    client = OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": family.question}]
    first = openai_reply(client, messages, stream)
    assert first.stop == "tool_calls" and first.content == ""
    assert first.call_args() == family.calls
    assert first.reasoning == family.reasoning[0]
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in first.calls
            ],
        }
    )
    messages += [
        {"role": "tool", "tool_call_id": i, "content": r}
        for (i, _, _), r in zip(first.calls, family.results, strict=True)
    ]
    second = openai_reply(client, messages, stream)
    assert (second.content, second.stop, second.calls) == (family.answer, "stop", [])
    assert second.reasoning == family.reasoning[1]
    check_merged(gw, episode_id, tok, family)


def anthropic_reply(client: anthropic.Anthropic, messages: list[dict], stream: bool):
    kwargs = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 160,
        "messages": messages,
        "tools": ANTHROPIC_TOOLS,
        "extra_body": GREEDY,
    }
    if not stream:
        return client.messages.create(**kwargs), None
    text = ""
    with client.messages.stream(**kwargs) as events:
        for event in events:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        return events.get_final_message(), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_use_round_trip(family_gateway, stream):
    family, gw, tok = family_gateway
    episode_id, key = gw.open_session()
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": family.question}]
    first, _ = anthropic_reply(client, messages, stream)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == family.calls
    thinking = [b.thinking for b in first.content if b.type == "thinking"]
    assert thinking == [r for r in family.reasoning[:1] if r]
    assert [b.type for b in first.content if b.type not in ("tool_use", "thinking")] == []
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": r}
                for u, r in zip(uses, family.results, strict=True)
            ],
        },
    ]
    second, streamed_text = anthropic_reply(client, messages, stream)
    assert second.stop_reason == "end_turn"
    assert [b.text for b in second.content if b.type == "text"] == [family.answer]
    assert [b.thinking for b in second.content if b.type == "thinking"] == [
        r for r in family.reasoning[1:] if r
    ]
    if stream:
        assert streamed_text == family.answer
    check_merged(gw, episode_id, tok, family)


def test_calls_that_do_not_decode_come_back_as_text(family_engine, family_dir, tmp_path):
    """Qwen3-Coder's XML read by the JSON-in-``<tool_call>`` parser: bad JSON inside the
    markers, so the completion is the answer's text on both routes, never an error."""
    [family] = [f for f in FAMILIES if f.parser == "qwen3_coder"]
    for _, gw, _ in serve_family(family_engine, family_dir, family, tmp_path, tool_parser="hermes"):
        client = OpenAI(base_url=gw.base_url + "/v1", api_key=gw.admin, max_retries=0)
        messages = [{"role": "user", "content": family.question}]
        reply = openai_reply(client, messages, stream=False)
        assert (reply.content, reply.calls, reply.stop) == (family.call_text, [], "stop")
        streamed = openai_reply(client, messages, stream=True)
        assert (streamed.content, streamed.calls) == (family.call_text, [])
        a = anthropic.Anthropic(base_url=gw.base_url, api_key=gw.admin, max_retries=0)
        message, text = anthropic_reply(a, messages, stream=True)
        assert message.stop_reason == "end_turn" and text == family.call_text
