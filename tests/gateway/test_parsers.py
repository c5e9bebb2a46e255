"""Tool-call parsers and reasoning separation, and their registration through the hook."""

from __future__ import annotations

import json

from areal_sdk.gateway.tool_parsers import parse_hermes, parse_json, split_reasoning
from areal_sdk.plugin_host import PluginHost


def test_hermes_parallel_calls_and_surrounding_text():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 3}"}</tool_call>'
    )
    out = parse_hermes(text)
    assert out.content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("add", {"a": 1, "b": 2}),
        ("mul", {"a": 3}),
    ]


def test_hermes_keeps_broken_blocks_as_text():
    text = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(text).content == text and parse_hermes(text).tool_calls == []
    unterminated = '<tool_call>{"name": "f", "arguments": {}}'
    assert [c.name for c in parse_hermes(unterminated).tool_calls] == ["f"]
    assert parse_hermes("plain answer").content == "plain answer"


def test_json_fallback():
    out = parse_json('{"name": "search", "arguments": {"q": "x"}}')
    assert out.content == "" and out.tool_calls[0].name == "search"
    many = parse_json('[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {"k": 1}}]')
    assert [c.name for c in many.tool_calls] == ["a", "b"]
    fenced = parse_json('Calling:\n```json\n{"name": "f", "arguments": {}}\n```')
    assert fenced.content == "Calling:" and fenced.tool_calls[0].name == "f"
    assert parse_json('{"answer": 5}').tool_calls == []
    assert parse_json("five").content == "five"


def test_reasoning_split():
    r = split_reasoning("<think>carry the one</think>\n\nIt is 5.")
    assert (r.reasoning, r.content) == ("carry the one", "It is 5.")
    assert split_reasoning("a stray</think>5").content == "a stray</think>5"  # no <think>
    r = split_reasoning("opened by the template</think>5", opened=True)  # in the prompt
    assert (r.reasoning, r.content) == ("opened by the template", "5")
    assert split_reasoning("<think>still going").content == ""
    assert split_reasoning("no thinking").reasoning is None


def test_parsers_register_through_the_hook():
    from areal_sdk.gateway import plugin

    host = PluginHost(load_entry_points=False)
    host.register(plugin, "gateway")
    parsers = host.tool_call_parsers()
    assert {"hermes", "json"} <= set(parsers)
    assert parsers["hermes"]('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls
