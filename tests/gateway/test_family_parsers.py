"""The parsers of Llama 3.x, Mistral, DeepSeek-V3, Qwen3-Coder and gpt-oss (harmony) on text:
parallel calls, malformed calls kept as text, the streaming cut, and template detection."""

from __future__ import annotations

import json

import pytest

from areal_sdk.gateway.conversation import Tool
from areal_sdk.gateway.tool_parsers import (
    BUILTIN_PARSERS,
    default_parser_name,
    parse_completion,
    reasoning_of,
)
from areal_sdk.gateway.tool_parsers.deepseek import parse_deepseek_v3
from areal_sdk.gateway.tool_parsers.harmony import parse_harmony
from areal_sdk.gateway.tool_parsers.llama import parse_llama3_json
from areal_sdk.gateway.tool_parsers.mistral import parse_mistral
from areal_sdk.gateway.tool_parsers.qwen3_coder import parse_qwen3_coder
from tests.gateway.family_templates import FAMILIES


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


ADD_2_3 = ("add", {"a": 2, "b": 3})
ADD_4_5 = ("add", {"a": 4, "b": 5})


def test_llama3_json_bare_tagged_and_parallel():
    bare = parse_llama3_json('{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert bare.content == "" and calls(bare) == [ADD_2_3]
    tagged = parse_llama3_json(
        'Adding.<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}'
    )
    assert tagged.content == "Adding." and calls(tagged) == [ADD_2_3]
    two = parse_llama3_json(
        '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 4, "b": 5}}'
    )
    assert calls(two) == [ADD_2_3, ADD_4_5]
    for text in [
        '{"name": "add", "parameters": {"a": 2,',
        '{"answer": 5}',
        "It is 5.",
        '{"name": "f"} and more',
    ]:
        assert parse_llama3_json(text).content == text and not parse_llama3_json(text).tool_calls


def test_mistral_list_form_and_name_args_form():
    listed = parse_mistral(
        'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 4, "b": 5}}]'
    )
    assert listed.content == "Sure." and calls(listed) == [ADD_2_3, ADD_4_5]
    newer = parse_mistral(
        '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]add[CALL_ID]x1y2z3a4b[ARGS]{"a": 4, "b": 5}'
    )
    assert newer.content == "" and calls(newer) == [ADD_2_3, ADD_4_5]
    for text in [
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}',
        "[TOOL_CALLS]add[ARGS]{oops}",
        "[TOOL_CALLS]add",
    ]:
        assert parse_mistral(text).content == text and not parse_mistral(text).tool_calls


DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{}\n```<｜tool▁call▁end｜>"


def test_deepseek_v3_fenced_calls_and_v31_form():
    text = (
        "Let me add.<｜tool▁calls▁begin｜>"
        + DS_CALL.replace("{}", '{"a": 2, "b": 3}')
        + "\n"
        + DS_CALL.replace("{}", '{"a": 4, "b": 5}')
        + "<｜tool▁calls▁end｜>"
    )
    out = parse_deepseek_v3(text)
    assert out.content == "Let me add." and calls(out) == [ADD_2_3, ADD_4_5]
    v31 = parse_deepseek_v3(
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 2, "b": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    assert calls(v31) == [ADD_2_3]
    broken = "<｜tool▁calls▁begin｜>" + DS_CALL.replace("{}", '{"a": ') + "<｜tool▁calls▁end｜>"
    assert parse_deepseek_v3(broken).content == broken and not parse_deepseek_v3(broken).tool_calls


QWEN_CALL = "<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"


def qwen_call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_values_typed_by_the_schema():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"type": "boolean"},
            "code": {"type": "string"},
            "tags": {"type": "array"},
            "opts": {"type": "object"},
            "maybe": {"type": ["integer", "null"]},
        },
    }
    text = (
        "Running it."
        + qwen_call(
            "run",
            n="2",
            x="1.5",
            flag="True",
            code="42",
            tags='["a", "b"]',
            opts='{"k": 1}',
            maybe="null",
            extra="[1]",
        )
        + "\n"
        + qwen_call("run", n="two")
    )
    out = parse_qwen3_coder(text, tools=[Tool("run", "", schema)])
    assert out.content == "Running it."
    assert calls(out) == [
        (
            "run",
            {
                "n": 2,
                "x": 1.5,
                "flag": True,
                "code": "42",
                "tags": ["a", "b"],
                "opts": {"k": 1},
                "maybe": None,
                "extra": [1],
            },
        ),
        ("run", {"n": "two"}),  # not an integer: kept as written
    ]
    # without tools (or through a parser host that passes none) values are read as JSON
    assert calls(parse_completion(parse_qwen3_coder, qwen_call("add", a="2", b="3"))) == [ADD_2_3]
    cut_off = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>"
    assert (
        parse_qwen3_coder(cut_off).content == cut_off and not parse_qwen3_coder(cut_off).tool_calls
    )


HARMONY_CALL = (
    "<|channel|>analysis<|message|>Add both.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{args}<|call|>"
)


def test_harmony_channels_and_calls():
    text = (
        HARMONY_CALL.replace("{args}", '{"a": 2, "b": 3}')
        + "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
        + '{"a": 4, "b": 5}<|call|>'
    )
    split = reasoning_of(parse_harmony, text)
    assert split.reasoning == "Add both."
    out = parse_completion(parse_harmony, split.content)
    assert out.content == "" and calls(out) == [ADD_2_3, ADD_4_5]
    answer = reasoning_of(
        parse_harmony,
        "<|channel|>analysis<|message|>It is 5.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 5.",
    )
    assert (answer.reasoning, answer.content) == ("It is 5.", "The answer is 5.")
    # a preamble in commentary is part of the answer; a model writing no channels is left as is
    assert (
        reasoning_of(parse_harmony, "<|channel|>commentary<|message|>Checking.<|end|>").content
        == "Checking."
    )
    assert reasoning_of(parse_harmony, "plain text").content == "plain text"
    broken = HARMONY_CALL.replace("{args}", '{"a": 2')
    out = parse_harmony(reasoning_of(parse_harmony, broken).content)
    assert not out.tool_calls and '{"a": 2' in out.content


@pytest.mark.parametrize(
    ("parser", "text", "shown"),
    [
        (parse_llama3_json, 'I will add.<|python_tag|>{"name"', "I will add."),
        (parse_llama3_json, '{"name": "add"', ""),
        (parse_llama3_json, "It is 5.", "It is 5."),
        (parse_mistral, "Sure.[TOOL_CALLS][{", "Sure."),
        (parse_mistral, "Sure.[TOOL_CA", "Sure."),
        (parse_deepseek_v3, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>func", "Sure."),
        (parse_qwen3_coder, "Sure.\n<tool_call>\n<function=add>", "Sure.\n"),
        (parse_qwen3_coder, "Sure.<function=ad", "Sure."),
        (
            parse_harmony,
            'Done.\n\n<|start|>assistant<|channel|>commentary to=functions.add<|message|>{"a"',
            "Done.\n\n",
        ),
        (parse_harmony, "Done.\n\nto=functions.add<|channel|>commentary", "Done."),
    ],
)
def test_live_cut_holds_back_a_call_that_may_have_begun(parser, text, shown):
    assert text[: parser.live_cut(text)] == shown


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.parser)
def test_parser_chosen_from_the_chat_template(family):
    assert default_parser_name(family.template) == family.parser
    assert BUILTIN_PARSERS[family.parser] is not None


def test_known_templates_keep_their_parsers():
    from tests.tiny_model import CHATML_TEMPLATE

    assert default_parser_name(CHATML_TEMPLATE) == "hermes"
    assert default_parser_name("{{ messages }}") == "json"


def test_a_parser_that_raises_leaves_the_text():
    def broken(text):
        raise RuntimeError("bug")

    assert parse_completion(broken, "hello").content == "hello"
