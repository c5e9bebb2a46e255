"""``weights.method: cuda_ipc`` into a server over SGLang's ``/update_weights_from_tensor``,
and the route's answers to bad input: a real embedded engine behind real HTTP on loopback.
The trainer's tensors are CPU tensors here, shared with the server (in this process) as
shared-memory file descriptors; on a GPU the same payload carries CUDA IPC handles."""

from __future__ import annotations

import base64
import contextlib
import pickle
from pathlib import Path

import httpx
import pytest
import torch
from areal_sdk.backends.embedded import EmbeddedEngine
from areal_sdk.backends.embedded.weights import load_into
from areal_sdk.backends.sglang import SGLangBackend
from areal_sdk.backends.sglang.tensor_sync import SGLangTensorSync
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync import WeightSyncError, make_weight_sync
from areal_sdk.backends.weight_sync.cuda_ipc import flattened_bucket, sglang_payload
from transformers import AutoModelForCausalLM

from areal_sdk.config import Config
from areal_sdk.inference import SamplingParams
from tests.backends.embedded.conftest import full_forward_logprobs
from tests.backends.train.common import loss_fn, micro_batches, train_config

PROMPT = [5, 17, 42, 99, 7, 3, 250, 12]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def config(model_dir: Path, run_dir: Path, **weights: object) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "run": {"dir": str(run_dir)},
            "train": {"device": "cpu"},
            "weights": {"method": "cuda_ipc", **weights},
        }
    )


def trainer_model(model_dir: Path, trainer: TorchBackend) -> torch.nn.Module:
    """A plain transformers model holding the trainer's current weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_into(model, {n: t for bucket in trainer.state_for_sync(1 << 30) for n, t in bucket})
    return model


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_a_push_makes_the_server_serve_the_trainers_model(
    backend: SGLangBackend, served: tuple[str, EmbeddedEngine], tiny_model_dir: Path, tmp_path
) -> None:
    url, engine = served
    sync = make_weight_sync("cuda_ipc", config(tiny_model_dir, tmp_path), engine=backend)
    assert isinstance(sync, SGLangTensorSync)
    trainer = TorchBackend(tiny_model_dir, train_config())
    before = await backend.generate(PROMPT, GREEDY)
    for _ in range(2):
        trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
        # Small buckets: many requests, only the last naming the version.
        result = await sync.push(trainer.state_for_sync(32 * 1024), trainer.version)
        assert result is not None and result.version == trainer.version
        assert result.tensors == len(trainer.named_parameters())
        assert engine.version == backend.version == trainer.version
        served_version = httpx.get(url + "/get_weight_version").json()["weight_version"]
        assert served_version == str(trainer.version)
    out = await backend.generate(PROMPT, GREEDY)
    model = trainer_model(tiny_model_dir, trainer)
    assert out.output_ids == greedy(model, PROMPT, GREEDY.max_new_tokens)
    assert out.versions == [2] * GREEDY.max_new_tokens
    expected = full_forward_logprobs(model, PROMPT, out.output_ids)
    torch.testing.assert_close(
        torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-4, rtol=0
    )
    # The push changed what the server samples: the initial weights scored differently.
    assert before.logprobs != pytest.approx(out.logprobs, abs=1e-3)


async def test_a_bfloat16_push_lands_as_bfloat16_values(
    backend: SGLangBackend, served: tuple[str, EmbeddedEngine], tiny_model_dir: Path, tmp_path
) -> None:
    _, engine = served
    sync = make_weight_sync(
        "cuda_ipc", config(tiny_model_dir, tmp_path, dtype="bfloat16"), engine=backend
    )
    trainer = TorchBackend(tiny_model_dir, train_config())
    trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
    result = await sync.push(trainer.state_for_sync(1 << 20), 7)
    assert result is not None and result.bytes == 2 * sum(
        p.numel() for _, p in trainer.named_parameters()
    )
    own = engine.runner.weights()
    name, param = trainer.named_parameters()[1]
    expected = param.detach().to(torch.bfloat16).float()
    torch.testing.assert_close(own[name].detach(), expected, atol=0, rtol=0)
    assert engine.version == 7


async def test_a_refused_bucket_fails_the_push_naming_server_and_version(
    backend: SGLangBackend, served: tuple[str, EmbeddedEngine]
) -> None:
    url, engine = served
    sync = SGLangTensorSync(backend, device="cpu", timeout_s=10)
    hidden = engine.model.config.hidden_size
    state = [[("model.norm.weight", torch.ones(hidden))], [("no.such.weight", torch.ones(2))]]
    with pytest.raises(WeightSyncError, match=rf"version 5 to SGLang servers {url}.*no\.such"):
        await sync.push(state, 5)
    assert engine.version == 0 and backend.version == 0


def tensor_body(payload: str, **extra: object) -> dict[str, object]:
    return {"serialized_named_tensors": [payload], "flush_cache": True, **extra}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def bad_bodies(engine: EmbeddedEngine) -> dict[str, tuple[dict[str, object], str]]:
    embed = dict(engine.model.named_parameters())["model.embed_tokens.weight"]
    norm = torch.ones(engine.model.config.hidden_size)
    bucket = flattened_bucket([("model.norm.weight", norm)], torch.device("cpu"), torch.float32)
    bucket["metadata"][0].end_idx += 1  # past the end of the buffer
    return {
        "bad base64": (tensor_body("not base64 !!"), "base64"),
        "unpicklable": (tensor_body(b64(b"\x80\x05garbage")), "unpickle"),
        "a foreign object": (tensor_body(b64(pickle.dumps(print))), "builtins.print"),
        "unknown name": (
            tensor_body(sglang_payload([("no.such.weight", torch.zeros(2))])),
            "no.such.weight",
        ),
        "shape mismatch": (
            tensor_body(sglang_payload([("model.embed_tokens.weight", torch.zeros(3, 3))])),
            f"expects {tuple(embed.shape)}",
        ),
        "empty list": (tensor_body(sglang_payload([])), "non-empty"),
        "bucket out of range": (
            tensor_body(sglang_payload(bucket), load_format="flattened_bucket"),
            "do not hold shape",
        ),
        "unknown load_format": (
            tensor_body(sglang_payload([("model.norm.weight", norm)]), load_format="x"),
            "load_format",
        ),
        "two TP payloads": (
            {"serialized_named_tensors": ["a", "b"]},
            "1 TP rank",
        ),
    }


async def test_bad_payloads_answer_400_and_the_engine_keeps_serving(
    served: tuple[str, EmbeddedEngine],
) -> None:
    url, engine = served
    norm = dict(engine.model.named_parameters())["model.norm.weight"].detach().clone()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for case, (body, clue) in bad_bodies(engine).items():
            response = await http.post("/update_weights_from_tensor", json=body)
            assert response.status_code == 400, case
            data = response.json()
            assert data["success"] is False and clue in data["message"], (case, data)
            gen = await http.post(
                "/generate",
                # ignore_eos: a random model may sample its EOS before the third token.
                json={
                    "input_ids": PROMPT,
                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                },
            )
            assert gen.status_code == 200 and len(gen.json()["output_ids"]) == 3, case
    assert engine.version == 0
    torch.testing.assert_close(dict(engine.model.named_parameters())["model.norm.weight"], norm)


async def test_direct_pairs_load_and_set_the_version(served: tuple[str, EmbeddedEngine]) -> None:
    url, engine = served
    new = torch.full((engine.model.config.hidden_size,), 0.5)
    body = tensor_body(
        sglang_payload([("model.norm.weight", new)]), load_format="direct", weight_version="3"
    )
    response = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["success"] is True
    assert engine.version == 3
    torch.testing.assert_close(dict(engine.model.named_parameters())["model.norm.weight"], new)


def param(engine: EmbeddedEngine, name: str) -> torch.Tensor:
    """The engine's parameter ``name`` as it serves now."""
    return dict(engine.model.named_parameters())[name]


async def test_a_staged_push_serves_the_old_weights_until_its_last_bucket(
    served: tuple[str, EmbeddedEngine],
) -> None:
    """Our servers take a push without a pause: buckets staged for a version change nothing
    that is sampled until the last one loads them all at once."""
    url, engine = served
    norm = param(engine, "model.norm.weight").detach().clone()
    new_norm = torch.full_like(norm, 0.25)
    embed = param(engine, "model.embed_tokens.weight")
    new_embed = torch.randn_like(embed.detach())
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        before = (await http.post("/generate", json=generate)).json()["output_ids"]
        staged = tensor_body(
            sglang_payload([("model.norm.weight", new_norm)]), stage_for_version="4"
        )
        response = await http.post("/update_weights_from_tensor", json=staged)
        assert response.status_code == 200 and "staged 1 tensors" in response.json()["message"]
        # Staged, not loaded: the same weights and version serve meanwhile.
        assert (await http.post("/generate", json=generate)).json()["output_ids"] == before
        torch.testing.assert_close(param(engine, "model.norm.weight"), norm)
        assert engine.version == 0
        last = tensor_body(
            sglang_payload([("model.embed_tokens.weight", new_embed)]),
            weight_version="4",
            staged_buckets=1,
        )
        response = await http.post("/update_weights_from_tensor", json=last)
        assert response.status_code == 200, response.text
    own = dict(engine.model.named_parameters())
    torch.testing.assert_close(own["model.norm.weight"], new_norm)
    torch.testing.assert_close(own["model.embed_tokens.weight"], new_embed)
    assert engine.version == 4


async def test_a_last_bucket_without_its_staged_ones_is_refused(
    served: tuple[str, EmbeddedEngine],
) -> None:
    """A server that joined mid-push, or lost a bucket, must not load half a version."""
    url, engine = served
    norm = param(engine, "model.norm.weight").detach().clone()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        staged = tensor_body(
            sglang_payload([("model.norm.weight", torch.zeros_like(norm))]), stage_for_version="2"
        )
        assert (await http.post("/update_weights_from_tensor", json=staged)).status_code == 200
        last = tensor_body(
            sglang_payload([("model.norm.weight", torch.ones_like(norm))]),
            weight_version="3",  # another version's push: the stage for 2 does not count
            staged_buckets=1,
        )
        response = await http.post("/update_weights_from_tensor", json=last)
    assert response.status_code == 400
    assert "incomplete push" in response.json()["message"]
    assert "staged 0 of 1 buckets" in response.json()["message"]
    assert engine.version == 0
    torch.testing.assert_close(param(engine, "model.norm.weight"), norm)


@pytest.mark.parametrize(("pause_mode", "pauses"), [("retract", 0), ("abort", 1)])
async def test_the_run_pushes_into_our_servers_without_a_pause(
    backend: SGLangBackend,
    served: tuple[str, EmbeddedEngine],
    tiny_model_dir: Path,
    tmp_path,
    pause_mode: str,
    pauses: int,
) -> None:
    """Generation goes on while the buckets travel; an abort still pauses (it must end the
    requests in flight)."""
    from areal_sdk.plugin_host import get_host
    from areal_sdk.training_run import WeightPusher

    _, engine = served
    cfg = config(tiny_model_dir, tmp_path, bucket_mb=1, pause_mode=pause_mode)
    trainer = TorchBackend(tiny_model_dir, train_config())
    trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
    pusher = WeightPusher(cfg, backend, trainer, get_host())
    parts = await pusher(trainer.version)
    assert backend._pauses == pauses
    assert engine.version == trainer.version
    assert set(parts) == {"time/push_pause_s", "time/push_send_s", "time/push_resume_s"}
    out = await backend.generate(PROMPT, GREEDY)
    assert out.output_ids == greedy(trainer_model(tiny_model_dir, trainer), PROMPT, 16)


async def test_a_server_joining_mid_push_gets_the_whole_version(
    backend: SGLangBackend, tiny_model_dir: Path, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """It missed the buckets staged before it joined, so it refuses the last one; the run
    pushes again, and every server then serves the trainer's weights."""
    from areal_sdk.plugin_host import get_host
    from areal_sdk.training_run import WeightPusher
    from tests.backends.sglang.conftest import engine_server, make_engine

    # Two servers open each payload: shared CPU memory by file name, which (as a CUDA IPC
    # handle) opens more than once; a passed file descriptor opens once.
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    late = make_engine(tiny_model_dir)
    with engine_server(late) as srv, contextlib.ExitStack() as restore:
        restore.callback(torch.multiprocessing.set_sharing_strategy, strategy)
        cfg = config(tiny_model_dir, tmp_path, bucket_mb=1)
        trainer = TorchBackend(tiny_model_dir, train_config())
        trainer.train_step(micro_batches(40)[0], loss_fn(trainer.step))
        pusher = WeightPusher(cfg, backend, trainer, get_host())
        pusher.bucket_bytes = 32 * 1024  # many buckets
        send = backend.update_weights_from_tensor
        calls = 0

        async def join_after_the_first_bucket(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 2:
                backend.add_server(srv.url)
            return await send(*args, **kwargs)

        backend.update_weights_from_tensor = join_after_the_first_bucket  # type: ignore[method-assign]
        await pusher(trainer.version)
        assert "incomplete push" in caplog.text and "pushing version 1 again" in caplog.text
        assert late.version == trainer.version
        expected = greedy(trainer_model(tiny_model_dir, trainer), PROMPT, 16)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
            }
            assert (await http.post("/generate", json=body)).json()["output_ids"] == expected
