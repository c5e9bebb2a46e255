"""The context a request gets is the model's: the default, and a refusal past it.

The tiny model has 2,048 positions (``max_position_embeddings``). A server left at its
defaults gives requests those 2,048 tokens, so a longer prompt is a 400 in the caller's own
format; a ``max_model_len`` beyond them is refused when the engine starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

from areal_sdk.cli import main
from areal_sdk.models import MaxModelLenError
from tests.gateway.conftest import Gateway, serve

POSITIONS = 2048
LONG = "What is 2 + 3? " * 400  # about 3,000 tokens


@pytest.fixture(scope="module")
def default_engine(tiny_model_dir: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine.from_pretrained(str(tiny_model_dir), config=EngineConfig(max_batch_size=1))
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
def default_gateway(default_engine: EmbeddedEngine, tmp_path: Path) -> Iterator[Gateway]:
    yield from serve(default_engine, tmp_path)


def test_the_default_context_is_the_models(default_engine, default_gateway):
    assert default_engine.max_model_len == POSITIONS
    assert len(default_engine.tokenizer(LONG)["input_ids"]) > POSITIONS
    ask = [{"role": "user", "content": LONG}]
    client = openai.OpenAI(
        base_url=default_gateway.base_url + "/v1", api_key=default_gateway.admin, max_retries=0
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=ask, max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    assert f"maximum context length is {POSITIONS} tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input=LONG, max_output_tokens=4)
    assert err.value.code == "context_length_exceeded"
    claude = anthropic.Anthropic(
        base_url=default_gateway.base_url, api_key=default_gateway.admin, max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="c", max_tokens=4, messages=ask)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    # a prompt that fits is served
    short = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert short.choices[0].message.role == "assistant"


def test_a_context_beyond_the_models_positions_is_refused(tiny_model_dir):
    with pytest.raises(MaxModelLenError, match="max_position_embeddings") as err:
        EmbeddedEngine.from_pretrained(
            str(tiny_model_dir), config=EngineConfig(max_batch_size=1, max_model_len=4096)
        )
    assert f"at most {POSITIONS}" in str(err.value)


def test_serve_refuses_it_with_an_error_line(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "serve",
                "--model",
                str(tiny_model_dir),
                "--max-model-len",
                "4096",
                "--run-dir",
                str(tmp_path),
            ]
        )
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: max_model_len 4096 exceeds the model's 2048 positions")
