"""The train backend in a child process (``train.separate_process``) against the same backend
in this process, on the tiny model: same losses, same logprobs, same weights after a sync,
checkpoints, errors and a dead child."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from areal_sdk.backends.embedded.engine import EmbeddedEngine
from areal_sdk.backends.train.torch_backend import TorchBackend
from areal_sdk.backends.weight_sync.in_process import InProcessSync

from areal_sdk.config import Config
from areal_sdk.train_process import TrainProcess, TrainProcessError, runs_apart
from tests.backends.train.common import FIXED_SEQUENCE, loss_fn, micro_batches, single


def config(model_dir: Path, **weights: object) -> Config:
    return Config(
        model={"path": str(model_dir)},
        train={"lr": 1e-2, "grad_clip": 1.0, "separate_process": True},
        weights=weights,
    )


@pytest.fixture(scope="module")
def child(tiny_model_dir: Path):
    process = TrainProcess(config(tiny_model_dir))
    yield process
    process.close()


def weights_of(backend, bucket_bytes: int = 64 * 1024) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in backend.state_for_sync(bucket_bytes) for n, t in b}


def test_the_child_trains_exactly_like_the_backend_in_this_process(
    child: TrainProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    local = TorchBackend.from_config(config(tiny_model_dir))
    batches = micro_batches(40)[0]
    start = child.step
    assert child.pid != os.getpid() and child.device == local.device
    for k in range(2):
        ours = local.train_step(batches, loss_fn(k))
        theirs = child.train_step(batches, loss_fn(k))
        assert theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5, abs=1e-7)
        assert theirs["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-5)
    assert child.step == start + 2 and child.version == start + 2
    probe = [single(FIXED_SEQUENCE)]
    torch.testing.assert_close(child.forward_logprobs(probe), local.forward_logprobs(probe))

    # The weights a sync reads are the child's trained ones, under the same names.
    pushed = weights_of(child)
    expected = weights_of(local)
    assert pushed.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(pushed[name], expected[name])

    # A checkpoint the child writes continues identically in this process, and back.
    child.save(tmp_path / "ckpt")
    resumed = TorchBackend.from_config(config(tiny_model_dir))
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == child.step
    assert resumed.train_step(batches, loss_fn(2))["loss"] == pytest.approx(
        local.train_step(batches, loss_fn(2))["loss"], rel=1e-5
    )
    child.load(tmp_path / "ckpt")
    assert child.step == start + 2


async def test_a_push_from_the_child_makes_the_engine_score_like_the_child(
    child: TrainProcess, tiny_model_dir: Path
) -> None:
    engine = EmbeddedEngine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32")
    try:
        child.train_step(micro_batches(40)[0], loss_fn(child.step))
        sync = InProcessSync(engine, timeout_s=30)
        await sync.push(child.state_for_sync(32 * 1024), child.version)
        assert engine.version == child.version
        scored = torch.tensor([x or 0.0 for x in await engine.score(FIXED_SEQUENCE)])
        expected = child.forward_logprobs([single(FIXED_SEQUENCE)])[0]
        torch.testing.assert_close(scored, expected, atol=1e-4, rtol=0)
    finally:
        await engine.close()


def test_two_weight_reads_at_once_each_get_every_weight(child) -> None:
    """A push and a restarted engine's catch-up read the weights at the same time; their
    calls interleave (one shared read once ended the other's: "sync_next without
    sync_begin", and the run stopped)."""
    want = weights_of(child)
    first, second = child.state_for_sync(64 * 1024), child.state_for_sync(64 * 1024)
    got: list[dict[str, torch.Tensor]] = [{}, {}]
    done = [False, False]
    while not all(done):
        for k, reader in enumerate((first, second)):
            if done[k]:
                continue
            bucket = next(reader, None)
            if bucket is None:
                done[k] = True
            else:
                got[k].update((n, t.clone()) for n, t in bucket)
    for read in got:
        assert read.keys() == want.keys()
        for name, tensor in want.items():
            torch.testing.assert_close(read[name], tensor)


def test_sync_buckets_arrive_in_the_configured_dtype(tiny_model_dir: Path) -> None:
    process = TrainProcess(config(tiny_model_dir, dtype="bfloat16"))
    try:
        pushed = weights_of(process)
        assert pushed and {t.dtype for t in pushed.values()} == {torch.bfloat16}
    finally:
        process.close()


def test_an_error_in_the_child_reaches_the_caller_and_the_child_serves_on(
    child: TrainProcess, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint") as caught:
        child.load(tmp_path / "nothing-here")
    assert "in the train process" in str(caught.value.__cause__)
    assert len(child.forward_logprobs([single(FIXED_SEQUENCE)])[0]) == len(FIXED_SEQUENCE)


def test_a_child_that_dies_fails_the_next_call_naming_its_exit(tiny_model_dir: Path) -> None:
    process = TrainProcess(config(tiny_model_dir))
    try:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TrainProcessError, match=r"died during train_step with exit code -9"):
            process.train_step(micro_batches(40)[0], loss_fn(0))
        assert time.monotonic() - started < 10
        with pytest.raises(TrainProcessError, match="closed"):
            process.forward_logprobs([single(FIXED_SEQUENCE)])
    finally:
        process.close()


def test_a_backend_that_cannot_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="missing") as caught:
        TrainProcess(config(tmp_path / "missing"))
    assert not isinstance(caught.value, TrainProcessError)  # the backend's own error


@pytest.mark.parametrize(
    ("train", "world_size", "apart"),
    [
        ({"device": "cuda"}, None, True),
        ({"device": "cuda:1"}, "1", True),
        ({"device": "cuda"}, "2", False),  # one rank of a DeepSpeed launch
        ({"device": "cpu"}, None, False),
        ({"device": "cuda", "separate_process": False}, None, False),
        ({"device": "cpu", "separate_process": True}, "2", True),
    ],
)
def test_a_single_rank_cuda_trainer_runs_apart_by_default(
    monkeypatch: pytest.MonkeyPatch, train: dict, world_size: str | None, apart: bool
) -> None:
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert runs_apart(Config(model={"path": "/models/m"}, train=train)) is apart
