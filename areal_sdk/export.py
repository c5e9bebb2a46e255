"""``areal-sdk export``: a run's trained model alone, for use anywhere.

A checkpoint (``run.dir/checkpoints/step-N``) is already a Hugging Face model directory, but
it holds float32 weights and the optimizer state a resumed run needs. ``export`` writes the
model alone: a Hugging Face directory in bfloat16 by default, or one GGUF file for
llama.cpp-based tools (``areal_sdk.gguf_export``).

>>> export_run("runs/gsm8k", "out/gsm8k-model")                          # doctest: +SKIP
>>> export_run("runs/gsm8k", "out/gsm8k.gguf", step=40, fmt="gguf")      # doctest: +SKIP
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import torch

from areal_sdk.checkpoints import TRAINER_STATE, Checkpoints

ExportFormat = Literal["hf", "gguf"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says why."""


def find_checkpoint(source: str | Path, step: int | None = None) -> Path:
    """The checkpoint to export: ``source`` itself when it is one, else the run directory's
    checkpoint of ``step`` (the newest when ``step`` is None)."""
    source = Path(source)
    if (source / TRAINER_STATE).is_file():
        if step is not None:
            raise ExportError(f"{source} is one checkpoint; --step picks one of a run directory")
        return source
    if not source.is_dir():
        raise ExportError(f"{source} is not a run directory")
    checkpoints = Checkpoints(source)
    if step is not None:
        try:
            return checkpoints.at_step(step).path
        except FileNotFoundError as exc:
            raise ExportError(str(exc)) from None
    latest = checkpoints.latest()
    if latest is None:
        raise ExportError(f"{source} has no checkpoint (looked in {checkpoints.root})")
    return latest.path


def _check_model_dir(checkpoint: Path) -> Path:
    if not (checkpoint / "config.json").is_file():
        raise ExportError(
            f"{checkpoint} holds no model directory (no config.json): it is a checkpoint of "
            "an earlier areal-sdk; resume the run (--resume) and export its next checkpoint"
        )
    return checkpoint


def export_run(
    source: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    fmt: ExportFormat = "hf",
    dtype: str = "bfloat16",
) -> Path:
    """Write the model of ``source`` (a run directory or one checkpoint) to ``out``: a
    directory for ``hf``; for ``gguf`` a file, ``out`` itself when it ends in ``.gguf``,
    else ``out/model.gguf``. Returns what was written."""
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; use {', '.join(DTYPES)}")
    checkpoint = _check_model_dir(find_checkpoint(source, step))
    out = Path(out)
    if fmt == "gguf":
        from areal_sdk.gguf_export import write_gguf

        target = out if out.suffix == ".gguf" else out / "model.gguf"
        _refuse_to_overwrite(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        run_name = checkpoint.parent.parent.name  # RUN/checkpoints/step-N
        write_gguf(checkpoint, partial, dtype=DTYPES[dtype], name=f"{run_name}-{checkpoint.name}")
        partial.replace(target)
        return target
    if fmt != "hf":
        raise ExportError(f"unknown format {fmt!r}; use hf or gguf")
    _refuse_to_overwrite(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_model_dir(checkpoint, partial, DTYPES[dtype])
    if out.exists():
        out.rmdir()  # empty, checked above
    partial.rename(out)
    return out


def write_model_dir(checkpoint: Path, out: Path, dtype: torch.dtype) -> None:
    """The checkpoint's model, weights cast to ``dtype``, tokenizer and configs: nothing of
    the trainer's state."""
    from transformers import AutoTokenizer

    from areal_sdk.models import load_causal_lm

    model = load_causal_lm(checkpoint, dtype=dtype)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True).save_pretrained(out)


def _refuse_to_overwrite(path: Path) -> None:
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise ExportError(f"{path} already exists; give a new path or remove it first")
