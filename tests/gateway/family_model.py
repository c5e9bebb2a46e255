"""One tiny model fitted to replay the tool conversation of every family in
``tests/gateway/family_templates.py``, and each family's tokenizer.

The vocabulary is a byte-level BPE learnt from the conversations, with every family's special
tokens; a family's tokenizer is that vocabulary with the family's chat template, BOS and EOS. For each
family the gateway's own ``PromptBuilder`` renders the first prompt and, from the first
prompt + sampled calls, the second (so it is exactly what the gateway will send); the model
is overfitted on both completions so that greedy decoding reproduces them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tests.gateway.family_templates import ADD_DESCRIPTION, ADD_SCHEMA, FAMILIES, Family


def family_tokenizer(model_dir: Path, family: Family) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = family.template
    tok.eos_token = family.eos
    tok.bos_token = family.bos
    return tok


def end_tokens() -> list[str]:
    """Every family's end-of-turn tokens: the model's generation config lists them all."""
    return sorted({t for f in FAMILIES for t in (f.eos, f.call_end)})


def conversation(model_dir: Path, family: Family) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of the family's two turns, as the gateway builds them."""
    from areal_sdk.gateway.conversation import Message, Tool, ToolCall
    from areal_sdk.gateway.templating import HistoryEntry, PromptBuilder, render_key

    tok = family_tokenizer(model_dir, family)
    builder = PromptBuilder(tok)
    builder.end_ids |= set(tok.convert_tokens_to_ids(end_tokens()))
    tools = [Tool("add", ADD_DESCRIPTION, ADD_SCHEMA)]
    first = [Message("user", family.question)]
    p1 = builder.build(first, tools).ids
    c1 = [*builder.encode(family.call_text), tok.convert_tokens_to_ids(family.call_end)]
    calls = [ToolCall(f"call_{i}", n, json.dumps(a)) for i, (n, a) in enumerate(family.calls)]
    reply = Message("assistant", "", tool_calls=calls)
    results = [Message("tool", r, tool_call_id=f"call_{i}") for i, r in enumerate(family.results)]
    entry = HistoryEntry(tuple(m.key() for m in first), reply.key(), render_key(tools, {}), p1, c1)
    second = builder.build([*first, reply, *results], tools, [entry])
    assert second.reused is not None, f"{family.parser}: {second.split_reason}"
    c2 = [*builder.encode(family.answer_text), tok.convert_tokens_to_ids(family.eos)]
    return [(p1, c1), (second.ids, c2)]


def _vocabulary(tiny_model_dir: Path, out: Path) -> Any:
    """A byte-level BPE trained on the families' conversations (so that a prompt is a few
    hundred tokens, not a thousand), with every family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tests.tiny_model import SPECIAL_TOKENS

    specials = list(dict.fromkeys([*SPECIAL_TOKENS, *(s for f in FAMILIES for s in f.specials)]))
    # Render the conversations with the tiny tokenizer (the text does not depend on the
    # vocabulary), then learn the vocabulary from them.
    draft = AutoTokenizer.from_pretrained(tiny_model_dir)
    draft.add_special_tokens({"additional_special_tokens": specials})
    corpus = []
    with tempfile.TemporaryDirectory() as tmp:  # not ``out``: loaded tokenizers are cached
        draft.save_pretrained(tmp)
        for family in FAMILIES:
            tok = family_tokenizer(Path(tmp), family)
            for prompt, completion in conversation(Path(tmp), family):
                corpus.append(tok.decode(prompt + completion, skip_special_tokens=False))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )
    fast.save_pretrained(out)
    return fast


def fit_family_model(tiny_model_dir: Path, out: Path, steps: int = 400) -> Path:
    """Write the vocabulary and a model fitted on every family's conversation into ``out``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _vocabulary(tiny_model_dir, out)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    # Before any tokenizing: with a config.json beside it the tokenizer loads as the model
    # type's class, as the engine and the gateway will load it.
    config.save_pretrained(out)
    # The second turn's sequence holds the first (its prompt extends prompt + calls), so one
    # row per family trains both completions.
    rows = []
    for family in FAMILIES:
        (p1, c1), (p2, c2) = conversation(out, family)
        assert p2[: len(p1) + len(c1)] == p1 + c1
        spans = [(len(p1), len(p1) + len(c1)), (len(p2), len(p2) + len(c2))]
        rows.append((p2 + c2, spans))
    model = Qwen2ForCausalLM(config)
    width = max(len(seq) for seq, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (seq, spans) in enumerate(rows):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        for start, end in spans:
            labels[row, start:end] = torch.tensor(seq[start:end])
    targets = labels[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small only contend for cores
    try:
        for _ in range(steps):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            losses = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
            )
            worst = losses.max().item()
            if worst < 0.02:  # every completion token far ahead of any other
                break
            opt.zero_grad()
            (losses.sum() / (targets != -100).sum()).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert worst < 0.1, f"the family model did not fit (worst token loss {worst:.3f})"
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tok.convert_tokens_to_ids(end_tokens()), pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    return out
