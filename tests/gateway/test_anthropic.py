"""/v1/messages through the official anthropic client."""

from __future__ import annotations

import anthropic
import httpx
from transformers import AutoTokenizer


def test_message_with_system_and_blocks(gateway, tiny_model_dir):
    episode_id, key = gateway.open_session()
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=key, max_retries=0)
    m = a.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=6,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is "},
                    {"type": "text", "text": "2 + 3?"},
                ],
            }
        ],
    )
    assert m.type == "message" and m.role == "assistant" and m.model == "claude-sonnet-4-5"
    assert m.id.startswith("msg_") and m.stop_reason in ("end_turn", "max_tokens")
    [turn] = gateway.episode(episode_id)["turns"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert turn["prompt_ids"] == expected and turn["api"] == "anthropic.messages"
    assert m.usage.input_tokens == len(expected) and m.usage.output_tokens == len(
        turn["completion_ids"]
    )
    ids = turn["completion_ids"]
    shown = ids[:-1] if ids[-1] == tok.eos_token_id else ids
    assert m.content[0].text == tok.decode(shown, skip_special_tokens=False)


def test_max_tokens_and_stop_sequences_map_to_stop_reason(gateway):
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.admin, max_retries=0)
    ask = [{"role": "user", "content": "Count: 1, 2, 3"}]
    long = a.messages.create(model="c", max_tokens=10, messages=ask, extra_body={"temperature": 0})
    if long.stop_reason == "max_tokens":
        text = long.content[0].text
        stop = text[3:5]
        cut = a.messages.create(
            model="c",
            max_tokens=10,
            messages=ask,
            stop_sequences=[stop],
            extra_body={"temperature": 0},
        )
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[: text.find(stop)]
    assert long.stop_reason in ("max_tokens", "end_turn")


def test_streaming_text(gateway):
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.admin, max_retries=0)
    ask = [{"role": "user", "content": "hello"}]
    plain = a.messages.create(model="c", max_tokens=8, messages=ask, extra_body={"temperature": 0})
    with a.messages.stream(
        model="c", max_tokens=8, messages=ask, extra_body={"temperature": 0}
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.usage.output_tokens == plain.usage.output_tokens
    r = httpx.post(
        gateway.base_url + "/v1/messages",
        headers={"x-api-key": gateway.admin},
        json={"model": "c", "max_tokens": 4, "stream": True, "messages": ask},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "ping" in names
    assert "[DONE]" not in r.text


def test_models_in_anthropic_shape(gateway, engine):
    a = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.admin, max_retries=0)
    page = a.models.list()
    assert [m.id for m in page.data] == [engine.model_name] and page.data[0].type == "model"
