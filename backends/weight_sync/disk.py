"""``disk``: safetensors on disk, one Hugging Face directory per version.

``push`` writes ``<dir>/v<version>/``: the weights as a checkpoint's are written (one shard
per bucket with ``model.safetensors.index.json``, or ``model.safetensors`` alone) and the
policy's ``config.json``, generation config and tokenizer files beside them, so the directory
is a complete HF checkpoint: the embedded engine's ``update_weights(dir, version)``, SGLang's
``/update_weights_from_disk`` and ``from_pretrained`` all load it. Each version is written
under a temporary name and renamed when complete, so a reader never sees half a checkpoint.
After the engine has loaded it, all but the newest ``keep_last`` version directories are
removed.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from areal_sdk.backends.weight_sync.base import (
    NamedTensors,
    WeightSync,
    cast_bucket,
    check_engine_version,
)

from areal_sdk.inference import InferenceBackend

VERSION_DIR = re.compile(r"^v(\d+)$")
# Files of an HF model directory that are not weights, copied into each version.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def write_hf_weights(
    state: Iterable[NamedTensors],
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    model_dir: str | Path | None = None,
) -> tuple[int, int]:
    """Write buckets as HF safetensors shards into ``out_dir`` (atomically). Returns
    (tensors, bytes). ``model_dir``'s config and tokenizer files are copied alongside."""
    from areal_sdk.checkpoints import write_safetensors

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        written = write_safetensors((cast_bucket(bucket, dtype) for bucket in state), tmp)
    except ValueError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if model_dir is not None:
        for name in SIDE_FILES:
            src = Path(model_dir) / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return written.tensors, written.nbytes


def cleanup_versions(root: str | Path, keep_last: int, *, keep: Iterable[Path] = ()) -> list[Path]:
    """Remove all but the newest ``keep_last`` version directories (never those in ``keep``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := VERSION_DIR.match(p.name))
    )
    protected = {Path(p).resolve() for p in keep}
    removed = []
    for _, path in found[: max(0, len(found) - keep_last)]:
        if path.resolve() in protected:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class DiskSync(WeightSync):
    """Weights through a safetensors directory per version; the engine loads it by path."""

    method = "disk"

    def __init__(
        self,
        engine: InferenceBackend,
        directory: str | Path,
        *,
        keep_last: int = 2,
        model_dir: str | Path | None = None,
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        trainer_rank: int = 0,
    ) -> None:
        super().__init__(timeout_s=timeout_s, dtype=dtype, trainer_rank=trainer_rank)
        if engine is None:
            raise ValueError(
                "the disk weight sync needs the engine (engine=...) to tell it to load"
            )
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.engine = engine
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.model_dir = model_dir

    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        path = version_dir(self.directory, version)
        peer = f"engine {type(self.engine).__name__} (loading {path})"
        try:
            # Writing blocks; gathering ZeRO-3 buckets inside it is fine from one thread.
            tensors, nbytes = await asyncio.to_thread(
                write_hf_weights, state, path, dtype=self.dtype, model_dir=self.model_dir
            )
        except OSError as exc:
            raise self._fail(version, peer, f"writing the weights failed: {exc}") from exc
        try:
            await asyncio.wait_for(self.engine.update_weights(path, version), self.timeout_s)
        except TimeoutError:
            raise self._fail(
                version, peer, f"the engine did not load it within {self.timeout_s:g} s"
            ) from None
        except Exception as exc:
            raise self._fail(version, peer, f"the engine failed to load it: {exc}") from exc
        check_engine_version(self, self.engine, version, peer)
        cleanup_versions(self.directory, self.keep_last, keep=[path])
        return tensors, nbytes
