"""Token exactness across turns: later calls continue the sampled ids, not re-tokenized text."""

from __future__ import annotations

import anthropic
import httpx
from openai import OpenAI
from transformers import AutoTokenizer

from areal_sdk.samples import MergeStats, build_samples
from tests.gateway.conftest import serve


def template_tail(tok, messages, completion_ids):
    """What ChatML adds after a sampled reply: the end marker unless it was sampled, "\\n",
    then the new messages and the next assistant header (rendered independently here)."""
    before = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=False)
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ended = completion_ids[-1] == tok.eos_token_id
    return ("\n" if ended else "<|im_end|>\n") + full[len(before) :]


def test_multi_turn_chat_merges_into_one_exact_sequence(gateway, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    episode_id, key = gateway.open_session(task_id="multi")
    client = OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    replies = []
    for follow_up in ["And 4 + 4?", "Are you sure?", None]:
        r = client.chat.completions.create(
            model="m", messages=messages, max_tokens=12, seed=len(replies)
        )
        replies.append(r.choices[0].message.content)
        if follow_up is None:
            break
        messages += [
            {"role": "assistant", "content": replies[-1]},
            {"role": "user", "content": follow_up},
        ]
    assert gateway.end(episode_id, reward=1.0).status_code == 200
    episode = gateway.store.get(episode_id)
    t1, t2, t3 = episode.turns
    stats = MergeStats()
    [sample] = build_samples(episode, stats=stats)
    assert stats.merged == 2 and stats.splits == 0
    # each later prompt starts with exactly the earlier prompt + the ids that were sampled
    assert (
        t2.prompt_ids[: len(t1.prompt_ids) + len(t1.completion_ids)]
        == t1.prompt_ids + t1.completion_ids
    )
    # ... and the rest is the template's own tokens for the new messages
    tail1 = tok(
        template_tail(
            tok,
            [*messages[:2], {"role": "assistant", "content": replies[0]}, messages[3]],
            t1.completion_ids,
        ),
        add_special_tokens=False,
    )["input_ids"]
    assert t2.prompt_ids == t1.prompt_ids + t1.completion_ids + tail1
    expected = [*t1.prompt_ids, *t1.completion_ids, *tail1, *t2.completion_ids]
    tail2 = t3.prompt_ids[len(expected) :]
    assert t3.prompt_ids == expected + tail2
    assert sample.input_ids == expected + tail2 + t3.completion_ids
    mask = (
        [0] * len(t1.prompt_ids)
        + [1] * len(t1.completion_ids)
        + [0] * len(tail1)
        + [1] * len(t2.completion_ids)
        + [0] * len(tail2)
        + [1] * len(t3.completion_ids)
    )
    assert sample.loss_mask == mask
    sampled_lp = [lp for lp, m in zip(sample.logprobs, mask, strict=True) if m]
    assert sampled_lp == t1.logprobs + t2.logprobs + t3.logprobs
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert "areal_gateway_history_merges_total 2.0" in metrics


def test_anthropic_multi_turn_merges_too(gateway):
    episode_id, key = gateway.open_session()
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = a.messages.create(
        model="claude-sonnet-4-5", max_tokens=10, system="Be brief.", messages=messages
    )
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks. And 1 + 1?"}]},
    ]
    a.messages.create(
        model="claude-sonnet-4-5", max_tokens=10, system="Be brief.", messages=messages
    )
    gateway.end(episode_id)
    episode = gateway.store.get(episode_id)
    stats = MergeStats()
    assert len(build_samples(episode, stats=stats)) == 1 and stats.merged == 1
    t1, t2 = episode.turns
    assert (
        t2.prompt_ids[: len(t1.prompt_ids) + len(t1.completion_ids)]
        == t1.prompt_ids + t1.completion_ids
    )


def test_an_edited_history_is_retokenized_and_the_split_counted(gateway):
    episode_id, key = gateway.open_session()
    client = OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    client.chat.completions.create(model="m", messages=ask, max_tokens=6)
    edited = [*ask, {"role": "assistant", "content": "5"}, {"role": "user", "content": "ok"}]
    client.chat.completions.create(model="m", messages=edited, max_tokens=6)
    gateway.end(episode_id)
    stats = MergeStats()
    samples = build_samples(gateway.store.get(episode_id), stats=stats)
    assert len(samples) == 2 and stats.splits == 1


# A template that renders earlier assistant turns differently from the last one (as Qwen3
# does with <think> blocks): the gateway must notice and count the split.
FORGETFUL = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n(earlier)<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_rewrites_history_counts_a_split(engine, tmp_path):
    for gw in serve(engine, tmp_path, chat_template=FORGETFUL):
        episode_id, key = gw.open_session()
        client = OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)
        ask = [{"role": "user", "content": "What is 2 + 3?"}]
        r = client.chat.completions.create(model="m", messages=ask, max_tokens=6)
        more = [
            *ask,
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "ok"},
        ]
        client.chat.completions.create(model="m", messages=more, max_tokens=6)
        turns = gw.episode(episode_id)["turns"]
        assert turns[1]["metadata"]["prompt_source"] == "template_not_prefix_preserving"
        metrics = httpx.get(gw.base_url + "/metrics").text
        assert (
            'areal_gateway_history_splits_total{reason="template_not_prefix_preserving"} 1.0'
            in metrics
        )
