"""Decode attention over the slot KV cache on CPU, from ``csrc/decode_attention.cpp``.

torch's CPU SDPA is built for long sequences: at a decode step's shape (one query per row,
16 rows, 3 KV heads, ~200 cached positions) it takes ~350 us a layer, a quarter of the
step, on ~10 MFLOP of work. The kernel here does the same arithmetic in ~10% of that.

It is compiled with torch's extension tools (``torch.utils.cpp_extension.load``) the first
time an engine needs it, ~10 s, and cached under torch's extension directory
(``$TORCH_EXTENSIONS_DIR``) afterwards. Where it cannot be built (no C++ compiler) the
engine keeps SDPA and says so once in the log.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernel; False where that fails."""
    if hasattr(torch.ops.areal_cpu, "decode_attention"):
        return True
    try:
        from torch.utils.cpp_extension import load

        load(
            name="areal_cpu_attention",
            sources=[str(_SOURCE)],
            # OpenMP for torch's parallel_for; the extension then binds torch's own libgomp.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no headers: SDPA still works
        log.warning("CPU decode attention kernel unavailable (%s); using SDPA", exc)
        return False
    return hasattr(torch.ops.areal_cpu, "decode_attention")


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
