"""glibc malloc settings for a run that trains and generates on CPU in one process.

torch allocates CPU tensors with the C library's ``malloc``. glibc gives each thread that
allocates its own *arena* (up to 8 per core), and memory freed inside an arena stays
resident for that arena's next allocations; only blocks over the mmap threshold (which
grows to 32 MiB after the first such free) go back to the system when freed. A run's
training steps run on whichever worker thread is free, so each thread that ever ran one
kept a step's activations (~1-2 GiB for SmolLM2) in its own arena: the quickstart reached
7.7 GiB resident after three steps, 5 GiB of it in arena heaps that held no live tensor.

``limit_arenas`` caps the arenas (like ``MALLOC_ARENA_MAX``, which only works when set
before the process starts) and ``release_free_memory`` hands the free pages of every arena
back (``malloc_trim``) once a step's tensors are gone. Elsewhere (another C library, no
glibc) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter, from glibc's malloc.h
# Two arenas: one for the engine's thread, one shared by every other (the trainer, agents,
# the gateway); contention is negligible since torch allocates few, large blocks.
ARENAS = 2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None  # not glibc (musl, macOS)
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas``; True where it took effect.

    Call it early: it bounds the arenas created after it (glibc fixes the cap once a
    process has made more than eight), not the ones that already exist."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Return the free pages of every malloc arena to the system; True if any went back."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
