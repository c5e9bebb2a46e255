"""The engine's CPU kernels (``csrc/``): decode attention, temperature sampling and the
fused elementwise steps of a Llama-family layer.

- ``decode_attention``: torch's CPU SDPA is built for long sequences; at a decode step's
  shape (one query per row, 16 rows, 3 KV heads, ~200 cached positions) it takes ~240 us a
  layer on ~6 MFLOP of work. The kernel takes ~80 us (AVX-512 where the CPU has it, plain
  loops elsewhere).
- ``sample_temperature``: inverse-CDF sampling with one uniform per row, instead of a
  Gumbel draw (a random number and two logarithms) for every vocabulary entry.
- ``add_rms_norm``: the residual add and the RMSNorm after it in one pass instead of seven
  torch kernels; ``silu_mul``: SiLU and the product with the up projection in one;
  ``rope_write``: rotary embedding of queries and keys and the KV-cache write in one.

They are compiled with torch's extension tools (``torch.utils.cpp_extension.load``) the
first time an engine on CPU starts, ~15 s, and cached under torch's extension directory
(``$TORCH_EXTENSIONS_DIR``) after. Where they cannot be built (no C++ compiler) the engine
keeps SDPA and the torch sampler and says so once in the log.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)
progress = logging.getLogger("areal_sdk.progress")  # shown by the CLI

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "decode_attention.cpp", _CSRC / "sample.cpp", _CSRC / "layer_ops.cpp"]
_DTYPES = (torch.float32, torch.bfloat16)
# The instruction set each of torch's CPU capabilities guarantees (not -march=native: the
# build is cached by capability, and two machines of one capability may differ beyond it).
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels; False where that fails."""
    if hasattr(torch.ops.areal_cpu, "rope_write"):
        return True
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build_dir = Path(_get_build_directory(_build_name(), verbose=False))
        if not (build_dir / f"{_build_name()}.so").is_file():
            progress.info("compiling the engine's CPU kernels (once per machine, about 20 s)")
        with _exclusive_build(build_dir):
            load(
                name=_build_name(),
                sources=[str(s) for s in _SOURCES],
                # OpenMP for torch's parallel_for; the extension then binds torch's libgomp.
                extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS.get(_capability(), [])],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as exc:  # no compiler, no headers: the torch paths still work
        log.warning("CPU kernels unavailable (%s); using SDPA and the torch sampler", exc)
        return False
    return hasattr(torch.ops.areal_cpu, "rope_write")


@contextlib.contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold an advisory lock on ``build_dir`` while torch builds or loads the kernels.

    torch's own build lock is a plain file (``lock``) that a build killed midway leaves
    behind, and every later ``load`` then waits on it forever. Builds here take an ``flock``
    first, which the kernel releases when its holder dies: whoever holds it knows no build is
    running, so a ``lock`` file found then is stale and removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".areal-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability().lower()


def _build_name() -> str:
    """The extension's name, which is also its cache directory: one build per instruction
    set, so a home directory shared by different machines never hands a CPU code it cannot
    run."""
    return f"areal_cpu_kernels_{platform.machine().lower()}_{_capability()}"


def usable(query: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes ``query``'s device and dtype."""
    return query.device.type == "cpu" and query.dtype in _DTYPES and available()


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``query [rows, heads, dim]`` over the first ``lengths[r]`` positions of slot
    ``slots[r]`` in ``[slots, kv_heads, len, dim]`` caches; ``[rows, heads, dim]`` out."""
    return torch.ops.areal_cpu.decode_attention(
        query, k_cache, v_cache, slots, lengths, float(scale)
    )


def sample_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of float32 ``logits [rows, vocab]`` from softmax(logits / T), argmax
    where ``T <= 0``; returns the tokens and their logprobs under log_softmax(logits / T)."""
    uniforms = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator)
    return torch.ops.areal_cpu.sample_temperature(logits, temperature, uniforms)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``hidden += delta`` in place (when given), then return ``hidden``'s RMSNorm times
    ``weight``, rounded as transformers' ``LlamaRMSNorm`` rounds. ``hidden`` contiguous."""
    return torch.ops.areal_cpu.add_rms_norm(hidden, delta, weight, float(eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = cat([gate, up], -1)``, the activation rounded to
    the input's dtype before the product as in transformers' MLP."""
    return torch.ops.areal_cpu.silu_mul(gate_up)


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotary embedding and the KV-cache write of one layer: ``qkv [rows, tokens, (heads + 2
    kv_heads) * dim]`` (queries, keys, values), ``cos``/``sin [rows, tokens, dim]``; each
    token's rotated key and its value go to ``(slots, :, positions)`` of the caches. Returns
    the rotated queries ``[rows, tokens, heads, dim]``, rounded as transformers rounds."""
    return torch.ops.areal_cpu.rope_write(qkv, cos, sin, k_cache, v_cache, slots, positions, heads)
