"""A run's episodes for reuse (SFT or preference data): JSON lines or Parquet, with text.

Every turn keeps its token ids, logprobs and versions, and gains ``prompt_text`` and
``completion_text``: its ids decoded by the run's own tokenizer with special tokens kept, so
``prompt_text + completion_text`` is exactly the sequence the engine saw. The tokenizer is
the model that the run's ``config.yaml`` names (``model.tokenizer``, ``model.path`` or
``model.name``), or one given by hand.

Parquet keeps one row per episode with its turns as a list of structs; ``request`` and both
``metadata`` fields are JSON strings (their shapes differ from call to call). A path ending
in ``.parquet`` is one file; any other path becomes a dataset directory in the Hugging Face
Hub's layout (``data/train-00000-of-00001.parquet``)::

    datasets.load_dataset("parquet", data_files="episodes.parquet")["train"]
    datasets.load_dataset("exported-dir")["train"]
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from areal_sdk.config import Config

RUN_CONFIG_FILENAME = "config.yaml"
PARQUET_DATA_FILE = Path("data") / "train-00000-of-00001.parquet"
_ROWS_PER_BATCH = 512


class ExportError(RuntimeError):
    """An export that cannot be done; the message says why and what to do instead."""


# -- the tokenizer ---------------------------------------------------------------------------


def model_of_run(run_dir: Path) -> str | None:
    """The tokenizer source that ``run_dir/config.yaml`` names, if any."""
    config = run_dir / RUN_CONFIG_FILENAME
    if not config.is_file():
        return None
    try:
        model = (yaml.safe_load(config.read_text()) or {}).get("model") or {}
        return model.get("tokenizer") or model.get("path") or model.get("name")
    except (yaml.YAMLError, AttributeError) as exc:
        raise ExportError(f"cannot read the model from {config}: {exc}") from None


def record_run_config(cfg: Config) -> str | None:
    """Write ``cfg`` into its run directory, so an export decodes the run's ids with its
    model's tokenizer; keep a config that is there (a training run's). Returns a note when
    the kept one names another model."""
    recorded = cfg.model_copy(deep=True)
    for field in ("path", "tokenizer"):  # paths relative to this cwd, made absolute
        value = getattr(recorded.model, field)
        if value and Path(value).exists():
            setattr(recorded.model, field, str(Path(value).resolve()))
    model = recorded.model
    source = model.tokenizer or model.path or model.name
    run_dir = Path(cfg.run.dir)
    path = run_dir / RUN_CONFIG_FILENAME
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(recorded.to_yaml())
        return None
    kept = model_of_run(run_dir)
    if kept != source:
        return f"{path} names the model {kept!r}; exports of {run_dir} decode with its tokenizer"
    return None


def load_tokenizer(source: str) -> Any:
    """A tokenizer from a local HF directory, a ``.gguf`` file or a cached registry name."""
    from transformers import AutoTokenizer

    from areal_sdk.models import ModelNotFoundError, resolve

    try:
        path = resolve(source, pull=False)
        if path.is_file():
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except (ModelNotFoundError, OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"cannot load the tokenizer of {source!r} to decode the turns ({reason}); pass "
            "--tokenizer MODEL (a model directory, .gguf file or registry name), or --no-text "
            "to export ids only"
        ) from None


def with_text(records: Iterable[dict[str, Any]], tokenizer: Any) -> Iterator[dict[str, Any]]:
    """Each record with ``prompt_text`` and ``completion_text`` added to every turn."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for record in records:
        for turn in record["turns"]:
            turn["prompt_text"] = decode(turn["prompt_ids"])
            turn["completion_text"] = decode(turn["completion_ids"])
        yield record


# -- where the output goes -------------------------------------------------------------------


def check_output(path: Path, fmt: str) -> Path:
    """The file to write for ``-o path``; an ``ExportError`` naming the problem if there is one."""
    target = path
    if fmt == "parquet" and path.suffix != ".parquet":
        if path.exists() and not path.is_dir():
            raise ExportError(
                f"{path} exists and is not a directory (a Parquet export to a path without "
                "the .parquet suffix writes a dataset directory)"
            )
        target = path / PARQUET_DATA_FILE
    elif path.is_dir():
        raise ExportError(f"{path} is a directory; give a file name")
    folder = path.parent
    if not folder.exists():
        raise ExportError(f"cannot write {path}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise ExportError(f"cannot write {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK):
        raise ExportError(f"cannot write {path}: {folder} is not writable")
    return target


def write_atomically(target: Path, write: Callable[[Path], int]) -> int:
    """Run ``write(partial_path)`` and move its file into place, so a failed export leaves
    no half-written file behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    try:
        count = write(partial)
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return count


# -- formats ---------------------------------------------------------------------------------


def write_jsonl(records: Iterable[dict[str, Any]], out: IO[str]) -> int:
    count = 0
    for record in records:
        out.write(json.dumps(record) + "\n")
        count += 1
    return count


def _parquet_schema() -> Any:
    import pyarrow as pa

    turn = pa.struct(
        [
            ("id", pa.string()),
            ("api", pa.string()),
            ("request", pa.string()),
            ("prompt_ids", pa.list_(pa.int32())),
            ("completion_ids", pa.list_(pa.int32())),
            ("logprobs", pa.list_(pa.float64())),
            ("versions", pa.list_(pa.int64())),
            ("finish_reason", pa.string()),
            ("reward", pa.float64()),
            ("metadata", pa.string()),
            ("prompt_text", pa.string()),
            ("completion_text", pa.string()),
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            ("run_id", pa.string()),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("error", pa.string()),
            ("metadata", pa.string()),
            ("started", pa.float64()),
            ("ended", pa.float64()),
            ("consumed_step", pa.int64()),
            ("turns", pa.list_(turn)),
        ]
    )


def _flat(record: dict[str, Any]) -> dict[str, Any]:
    """A record with its free-form JSON fields as strings, which Parquet columns need."""
    record = dict(record, metadata=json.dumps(record.get("metadata") or {}))
    record["turns"] = [
        dict(
            turn,
            request=json.dumps(turn.get("request") or {}),
            metadata=json.dumps(turn.get("metadata") or {}),
        )
        for turn in record["turns"]
    ]
    return record


def write_parquet(records: Iterable[dict[str, Any]], path: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError(
            "--format parquet needs pyarrow: pip install 'areal-sdk[export]'"
        ) from None
    schema = _parquet_schema()
    count = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        batch: list[dict[str, Any]] = []
        for record in records:
            batch.append(_flat(record))
            if len(batch) == _ROWS_PER_BATCH:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                count += len(batch)
                batch = []
        writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        count += len(batch)
    return count
