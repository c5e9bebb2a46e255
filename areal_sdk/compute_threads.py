"""Loading models on a thread that exits, so that it leaves no OpenMP team behind.

On CPU, torch runs a parallel region (a matrix product, a large copy) on an OpenMP team
owned by the calling thread, and the team lives as long as that thread. libgomp counts the
workers of every live team; once they outnumber the CPUs (two teams on a 2-core machine) it
stops letting idle workers spin, and every parallel region in every team pays a futex
wake-up: a decode-shaped product ran ~1.8x slower. Loading a model copies its tensors in
parallel, so the loading thread gets a team; when that thread lives on (the main thread of
``areal-sdk engine``, a pool thread) the engine's own thread computes beside an idle team:
SmolLM2 generated 109 tokens/s after loading on the main thread, 144 after loading on a
thread that had exited (``benchmarks/engine.md``). ``OMP_WAIT_POLICY`` and
``GOMP_SPINCOUNT`` do not avoid it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def call_in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new thread that exits when it returns; its result or
    exception comes back to the caller."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"areal-{getattr(fn, '__name__', 'work')}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call_in_fresh_thread`` without blocking the event loop (the pool thread that waits
    for it only joins; it computes nothing)."""
    return await asyncio.to_thread(call_in_fresh_thread, fn, *args, **kwargs)
