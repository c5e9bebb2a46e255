"""A copy of the tiny model fitted to really produce a tool call, then an answer.

Conversation: the user asks for 2 + 3 with an ``add`` tool; the model calls
``add(a=2, b=3)``; after the tool result ``5`` it answers ``The answer is 5.``. The training
sequences are built by the gateway's own ``PromptBuilder`` (so the second prompt is the first
prompt + sampled call + template tokens, exactly what the gateway will send), and the model
is overfitted on them so that greedy decoding reproduces them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QUESTION = "What is 2 + 3? Use the add tool."
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD_DESCRIPTION = "Add two integers."
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": ADD_DESCRIPTION, "parameters": ADD_SCHEMA},
    }
]


def fit_tool_model(src: Path, out: Path, steps: int = 150) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_sdk.gateway.conversation import Message, Tool, ToolCall
    from areal_sdk.gateway.templating import HistoryEntry, PromptBuilder, render_key

    shutil.copytree(src, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    builder = PromptBuilder(tok)
    tools = [Tool("add", ADD_DESCRIPTION, ADD_SCHEMA)]
    first = [Message("user", QUESTION)]
    p1 = builder.build(first, tools).ids
    c1 = [*builder.encode(CALL_TEXT), tok.eos_token_id]
    call = ToolCall("call_x", "add", json.dumps({"a": 2, "b": 3}))
    reply = Message("assistant", "", tool_calls=[call])
    second = [*first, reply, Message("tool", "5", tool_call_id="call_x")]
    entry = HistoryEntry(tuple(m.key() for m in first), reply.key(), render_key(tools, {}), p1, c1)
    p2 = builder.build(second, tools, [entry]).ids
    c2 = [*builder.encode(ANSWER), tok.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    seqs = [(p1, c1), (p2, c2)]
    for _ in range(steps):
        loss = 0.0
        for p, c in seqs:
            ids = torch.tensor([p + c])
            labels = torch.tensor([[-100] * len(p) + c])
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(out, safe_serialization=True)
    return out
