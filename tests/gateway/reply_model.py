"""A copy of the tiny model fitted to answer ``Say hi.`` with ``Hi there!`` and stop on its own.

The reply ends in the model's EOS, ``<|im_end|>``, a special token: the case where a stream
could leak the end-of-turn marker as text. The model is overfitted on two sequences, the
chat template's prompt (what the chat, responses and messages routes send) and the raw
prompt of ``/v1/completions``, so that greedy decoding reproduces the reply on every route.
"""

from __future__ import annotations

import shutil
from pathlib import Path

QUESTION = "Say hi."
REPLY = "Hi there!"


def fit_reply_model(src: Path, out: Path, steps: int = 200) -> Path:
    """Fit a copy of ``src`` in ``out`` until greedy decoding gives the reply (~40 steps)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_sdk.gateway.conversation import Message
    from areal_sdk.gateway.templating import PromptBuilder

    shutil.copytree(src, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    builder = PromptBuilder(tok)
    reply = [*builder.encode(REPLY), tok.eos_token_id]
    seqs = [
        (builder.build([Message("user", QUESTION)], []).ids, reply),
        (builder.encode(QUESTION), [*builder.encode(" " + REPLY), tok.eos_token_id]),
    ]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small only contend for cores: 30x faster on two
    try:
        for _ in range(steps):
            loss = 0.0
            for p, c in seqs:
                ids = torch.tensor([p + c])
                labels = torch.tensor([[-100] * len(p) + c])
                loss = loss + model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.05:  # each reply token far ahead of any other
                break
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    return out
