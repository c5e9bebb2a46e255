"""Chat templates in the formats of five model families, and one tool conversation in each.

Written here from each family's published format (no hub downloads): the markers, roles and
tool-call syntax of Llama 3.x, Mistral, DeepSeek-V3, Qwen3-Coder and gpt-oss's harmony, cut
down to what a tool conversation needs. ``tests/gateway/family_model.py`` fits one tiny model
to every conversation, and each family's tokenizer is the same vocabulary with its template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD_DESCRIPTION = "Add two integers."
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": ADD_DESCRIPTION, "parameters": ADD_SCHEMA},
    }
]
ANTHROPIC_TOOLS = [{"name": "add", "description": ADD_DESCRIPTION, "input_schema": ADD_SCHEMA}]

TWO_SUMS = "What are 2 + 3 and 4 + 5? Use the add tool."
ONE_SUM = "What is 2 + 3? Use the add tool."


def _template(*lines: str) -> str:
    return "".join(lines)


LLAMA3 = _template(
    "{{- bos_token }}",
    "{%- if tools %}",
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou have access to these functions. To"
    ' call one, respond with JSON {"name": function name, "parameters": arguments}; separate'
    " several calls with ; and use no <|python_tag|>.\\n\\n' }}",
    "{%- for t in tools %}{{- t.function | tojson + '\\n' }}{%- endfor %}",
    "{{- '<|eot_id|>' }}",
    "{%- endif %}",
    "{%- for m in messages %}",
    "{%- if m.role == 'assistant' and m.tool_calls %}",
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}",
    "{%- for c in m.tool_calls %}{%- if not loop.first %}{{- '; ' }}{%- endif %}",
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + c.function.arguments | tojson + '}' }}",
    "{%- endfor %}{{- '<|eot_id|>' }}",
    "{%- elif m.role == 'tool' %}",
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}",
    "{%- else %}",
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
)

MISTRAL = _template(
    "{{- bos_token }}",
    "{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}",
    "{%- for m in messages %}",
    "{%- if m.role == 'system' %}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' }}",
    "{%- elif m.role == 'user' %}{{- '[INST]' + m.content + '[/INST]' }}",
    "{%- elif m.role == 'assistant' %}",
    "{{- m.content }}",
    "{%- if m.tool_calls %}{{- '[TOOL_CALLS][' }}",
    "{%- for c in m.tool_calls %}{%- if not loop.first %}{{- ', ' }}{%- endif %}",
    "{{- {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}",
    "{%- endfor %}{{- ']' }}{%- endif %}",
    "{{- eos_token }}",
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}",
    "{%- endif %}",
    "{%- endfor %}",
)

DEEPSEEK_V3 = _template(
    "{{- bos_token }}",
    "{%- set ns = namespace(is_tool=false) %}",
    "{%- if tools %}{{- '## Tools\\nYou have access to the following tools:\\n' }}",
    "{%- for t in tools %}{{- '### ' + t.function.name + '\\nDescription: ' + t.function.description"
    " + '\\nParameters: ' + t.function.parameters | tojson + '\\n' }}{%- endfor %}",
    "{%- endif %}",
    "{%- for m in messages %}",
    "{%- if m.role == 'user' %}{%- set ns.is_tool = false %}{{- '<｜User｜>' + m.content }}",
    "{%- elif m.role == 'assistant' %}",
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- else %}{{- '<｜Assistant｜>' }}{%- endif %}",
    "{%- set ns.is_tool = false %}",
    "{{- m.content }}",
    "{%- if m.tool_calls %}{{- '<｜tool▁calls▁begin｜>' }}",
    "{%- for c in m.tool_calls %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}",
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + c.function.name + '\\n```json\\n'"
    " + c.function.arguments | tojson + '\\n```<｜tool▁call▁end｜>' }}",
    "{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}",
    "{{- '<｜end▁of▁sentence｜>' }}",
    "{%- elif m.role == 'tool' %}",
    "{%- if ns.is_tool %}{{- '\\n<｜tool▁output▁begin｜>' }}",
    "{%- else %}{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' }}{%- endif %}",
    "{%- set ns.is_tool = true %}",
    "{{- m.content + '<｜tool▁output▁end｜>' }}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}",
    "{%- if add_generation_prompt and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}",
)

QWEN3_CODER = _template(
    "{%- if tools %}",
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}",
    "{%- for t in tools %}{{- '\\n<function>\\n<name>' + t.function.name + '</name>\\n<parameters>' }}",
    "{%- for p, s in t.function.parameters.properties | items %}",
    "{{- '\\n<parameter>\\n<name>' + p + '</name>\\n<type>' + s.type + '</type>\\n</parameter>' }}",
    "{%- endfor %}{{- '\\n</parameters>\\n</function>' }}{%- endfor %}",
    "{{- '\\n</tools>\\n\\nTo call a function reply with <tool_call>\\n<function=name>\\n<parameter=x>\\n"
    "value\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- for m in messages %}",
    "{%- if m.role == 'assistant' %}",
    "{{- '<|im_start|>assistant\\n' + m.content }}",
    "{%- for c in m.tool_calls | default([], true) %}",
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}",
    "{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}",
    "{%- for k, v in c.function.arguments | items %}",
    "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}",
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}",
    "{%- endfor %}{{- '<|im_end|>\\n' }}",
    "{%- elif m.role == 'tool' %}",
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user\\n' }}{%- endif %}",
    "{{- '<tool_response>\\n' + m.content + '\\n</tool_response>\\n' }}",
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- else %}",
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
)

HARMONY = _template(
    "{{- '<|start|>system<|message|>Reasoning: low\\n\\n# Valid channels: analysis, commentary,"
    " final. Channel must be included for every message.' }}",
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}",
    "{{- '<|end|>' }}",
    "{%- if tools %}",
    "{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}",
    "{%- for t in tools %}{{- '// ' + t.function.description + '\\ntype ' + t.function.name"
    " + ' = (_: ' + t.function.parameters | tojson + ') => any;\\n\\n' }}{%- endfor %}",
    "{{- '} // namespace functions<|end|>' }}",
    "{%- endif %}",
    "{%- set ns = namespace(calls=[]) %}",
    "{%- for m in messages %}",
    "{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}",
    "{%- elif m.role == 'system' %}{{- '<|start|>developer<|message|># Instructions\\n\\n' + m.content + '<|end|>' }}",
    "{%- elif m.role == 'assistant' and m.tool_calls %}",
    "{%- if m.content %}{{- '<|start|>assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}{%- endif %}",
    "{%- set ns.calls = m.tool_calls | map(attribute='function') | map(attribute='name') | list %}",
    "{%- for c in m.tool_calls %}",
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + c.function.name"
    " + ' <|constrain|>json<|message|>' + c.function.arguments | tojson + '<|call|>' }}",
    "{%- endfor %}",
    "{%- elif m.role == 'assistant' %}",
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}",
    "{%- elif m.role == 'tool' %}",
    "{{- '<|start|>functions.' + ns.calls[0] + ' to=assistant<|channel|>commentary<|message|>'"
    " + m.content + '<|end|>' }}",
    "{%- set ns.calls = ns.calls[1:] %}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}",
)


@dataclass(frozen=True)
class Family:
    """One family's template and a two-turn tool conversation the fitted model replays."""

    parser: str
    template: str
    bos: str | None
    eos: str  # the tokenizer's eos_token
    question: str
    calls: list[tuple[str, dict[str, Any]]]
    results: list[str]
    call_text: str  # turn 1 as sampled, before its end token
    call_end: str  # the token that ends turn 1
    answer_text: str  # turn 2 as sampled, before its end token
    answer: str  # turn 2's content
    reasoning: tuple[str | None, str | None] = (None, None)  # of turn 1 and turn 2
    specials: list[str] = field(default_factory=list)


SUMS = [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]
TWO_ANSWER = "They are 5 and 9."

FAMILIES = [
    Family(
        parser="llama3_json",
        template=LLAMA3,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        question=TWO_SUMS,
        calls=SUMS,
        results=["5", "9"],
        call_text='{"name": "add", "parameters": {"a": 2, "b": 3}}; '
        '{"name": "add", "parameters": {"a": 4, "b": 5}}',
        call_end="<|eot_id|>",
        answer_text=TWO_ANSWER,
        answer=TWO_ANSWER,
        specials=[
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
    ),
    Family(
        parser="mistral",
        template=MISTRAL,
        bos="<s>",
        eos="</s>",
        question=TWO_SUMS,
        calls=SUMS,
        results=["5", "9"],
        call_text='[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, '
        '{"name": "add", "arguments": {"a": 4, "b": 5}}]',
        call_end="</s>",
        answer_text=TWO_ANSWER,
        answer=TWO_ANSWER,
        specials=[
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[ARGS]",
            "[CALL_ID]",
        ],
    ),
    Family(
        parser="deepseek_v3",
        template=DEEPSEEK_V3,
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        question=TWO_SUMS,
        calls=SUMS,
        results=["5", "9"],
        call_text="<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 2, "b": 3}\n```<｜tool▁call▁end｜>\n'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 4, "b": 5}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        call_end="<｜end▁of▁sentence｜>",
        answer_text=TWO_ANSWER,
        answer=TWO_ANSWER,
        specials=[
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
    ),
    Family(
        parser="qwen3_coder",
        template=QWEN3_CODER,
        bos=None,
        eos="<|im_end|>",
        question=TWO_SUMS,
        calls=SUMS,
        results=["5", "9"],
        call_text="<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n4\n"
        "</parameter>\n<parameter=b>\n5\n</parameter>\n</function>\n</tool_call>",
        call_end="<|im_end|>",
        answer_text=TWO_ANSWER,
        answer=TWO_ANSWER,
    ),
    Family(
        parser="harmony",
        template=HARMONY,
        bos=None,
        eos="<|return|>",
        question=ONE_SUM,
        calls=[("add", {"a": 2, "b": 3})],
        results=["5"],
        call_text="<|channel|>analysis<|message|>Add 2 and 3 with the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json"
        '<|message|>{"a": 2, "b": 3}',
        call_end="<|call|>",
        answer_text="<|channel|>analysis<|message|>The tool said 5.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer is 5.",
        answer="The answer is 5.",
        reasoning=("Add 2 and 3 with the tool.", "The tool said 5."),
        specials=[
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ],
    ),
]
