"""``areal-sdk trajectories export`` as a user runs it: episodes recorded by a real
``areal-sdk serve`` (tiny model, loopback), exported with their text as JSON lines and as
Parquet that ``datasets`` loads; bad paths get one ``error:`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from areal_sdk.store import TrajectoryStore
from areal_sdk.trajectory import Episode

ADMIN = "export-admin"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_sdk", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def served_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A serve run directory holding one ended episode of two calls (OpenAI and Anthropic).

    The config names a training run's directory; serve must leave it alone."""
    work = tmp_path_factory.mktemp("serve-cwd")
    config = work / "serve.yaml"
    config.write_text(
        f"model:\n  path: {tiny_model_dir}\ninference:\n  port: 0\n  max_model_len: 512\n"
        "run:\n  dir: training-run\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_sdk", "serve", str(config)],
        cwd=work,
        env={**os.environ, "AREAL_SDK_ADMIN_TOKEN": ADMIN},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = None
        deadline = time.monotonic() + 120
        while base is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("gateway:"):
                base = line.split()[1]
        assert base is not None, "serve printed no gateway line"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        session = httpx.post(f"{base}/rl/sessions", json={"task_id": "sum-1"}, headers=admin)
        session.raise_for_status()
        key = session.json()["api_key"]
        OpenAI(base_url=session.json()["openai_base_url"], api_key=key).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=4
        )
        import anthropic

        anthropic.Anthropic(
            base_url=session.json()["anthropic_base_url"], api_key=key
        ).messages.create(
            model="claude-sonnet-4-5",
            max_tokens=4,
            messages=[{"role": "user", "content": "And 4 + 4?"}],
        )
        ended = httpx.post(
            f"{base}/rl/sessions/{session.json()['id']}/end", json={"reward": 1.0}, headers=admin
        )
        assert ended.json()["stored"] is True
    finally:
        proc.terminate()
        proc.wait(30)
    yield work


@pytest.mark.slow
def test_serve_stores_in_its_own_run_dir_not_the_configs(served_run):
    assert not (served_run / "training-run").exists()
    with TrajectoryStore.open_existing(served_run / "runs" / "serve") as store:
        assert store.runs() == ["serve"]
        assert [e.task_id for e in store.query()] == ["sum-1"]


@pytest.mark.slow
def test_jsonl_export_carries_each_turns_text(served_run, tiny_model_dir):
    from transformers import AutoTokenizer

    proc = cli("trajectories", "export", "runs/serve", cwd=served_run)
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(line) for line in proc.stdout.splitlines()]
    openai_turn, anthropic_turn = record["turns"]
    assert (openai_turn["api"], anthropic_turn["api"]) == ("openai.chat", "anthropic.messages")
    assert "What is 2 + 3?" in openai_turn["prompt_text"]
    assert "And 4 + 4?" in anthropic_turn["prompt_text"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for turn in record["turns"]:
        ids = turn["prompt_ids"] + turn["completion_ids"]
        assert turn["prompt_text"] + turn["completion_text"] == tokenizer.decode(ids)


@pytest.mark.slow
def test_parquet_export_loads_with_datasets_as_file_and_as_directory(served_run, tmp_path):
    datasets = pytest.importorskip("datasets")
    jsonl = cli("trajectories", "export", "runs/serve", cwd=served_run)
    (expected,) = [json.loads(line) for line in jsonl.stdout.splitlines()]

    as_file = tmp_path / "episodes.parquet"
    as_dir = tmp_path / "episodes-dataset"
    for target in (as_file, as_dir):
        proc = cli("trajectories", "export", "runs/serve", "--format", "parquet", "-o", str(target), cwd=served_run)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "wrote 1 episodes" in proc.stderr
    cache = str(tmp_path / "hf-cache")
    loaded = [
        datasets.load_dataset("parquet", data_files=str(as_file), cache_dir=cache)["train"],
        datasets.load_dataset(str(as_dir), cache_dir=cache)["train"],
    ]
    for rows in loaded:
        (row,) = list(rows)
        assert (row["task_id"], row["reward"], row["run_id"]) == ("sum-1", 1.0, "serve")
        for got, want in zip(row["turns"], expected["turns"], strict=True):
            for field in ("prompt_ids", "completion_ids", "logprobs", "versions"):
                assert got[field] == want[field]
            assert got["prompt_text"] == want["prompt_text"]
            assert got["completion_text"] == want["completion_text"]
            assert json.loads(got["request"]) == want["request"]


@pytest.fixture
def plain_run(tmp_path: Path) -> Path:
    with TrajectoryStore(tmp_path / "run") as store:
        store.append(Episode(task_id="a", reward=1.0))
    (tmp_path / "a-file").write_text("not a store")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{t}/run", "-o", "{t}/missing/out.jsonl"], "the folder {t}/missing does not exist"),
        (["{t}/run", "-o", "{t}/a-file/out.jsonl"], "{t}/a-file is not a directory"),
        (["{t}/run", "-o", "{t}"], "{t} is a directory"),
        (["{t}/run", "--format", "parquet", "-o", "{t}/a-file"], "{t}/a-file exists and is not"),
        (["{t}/run", "--format", "parquet"], "give -o FILE.parquet or -o DIR"),
        (["{t}/nope"], "no trajectory store: {t}/nope does not exist"),
        (["{t}/a-file"], "{t}/a-file is not a trajectory store"),
        (["{t}/[bold]/run"], "{t}/[bold]/run does not exist"),  # printed as it is
    ],
    ids=[
        "missing-folder",
        "under-a-file",
        "onto-a-directory",
        "dataset-onto-a-file",
        "parquet-to-stdout",
        "missing-run",
        "not-a-store",
        "brackets-in-the-path",
    ],
)
def test_export_errors_are_one_line_and_exit_1(plain_run, args, message):
    proc = cli("trajectories", "export", *(a.format(t=plain_run) for a in args))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
    assert message.format(t=plain_run) in proc.stderr
    assert not (plain_run / "missing").exists()  # nothing created on the way


def test_a_run_without_config_exports_ids_and_says_how_to_get_text(plain_run):
    proc = cli("trajectories", "export", str(plain_run / "run"))
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["task_id"] == "a"
    assert "pass --tokenizer MODEL" in proc.stderr


def test_a_model_that_cannot_be_loaded_says_how_to_export_anyway(plain_run, tiny_model_dir):
    from transformers import AutoTokenizer

    from areal_sdk.trajectory import Turn

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)("What is 2 + 3?")["input_ids"]
    with TrajectoryStore(plain_run / "moved") as store:
        turn = Turn(api="openai.chat", prompt_ids=ids, completion_ids=[], logprobs=[], versions=[])
        store.append(Episode(task_id="b", turns=[turn]))
    (plain_run / "moved" / "config.yaml").write_text("model:\n  path: /nowhere/model\n")
    run = str(plain_run / "moved")

    proc = cli("trajectories", "export", run)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "'/nowhere/model'" in proc.stderr and "--tokenizer MODEL" in proc.stderr
    assert "Traceback" not in proc.stderr

    text = cli("trajectories", "export", run, "--tokenizer", str(tiny_model_dir))
    assert json.loads(text.stdout)["turns"][0]["prompt_text"] == "What is 2 + 3?"
    ids_only = cli("trajectories", "export", run, "--no-text")
    assert "prompt_text" not in json.loads(ids_only.stdout)["turns"][0]
