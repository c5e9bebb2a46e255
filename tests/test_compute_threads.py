"""Work on a fresh thread comes back (or raises) and leaves no thread behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal_sdk.compute_threads import call_in_fresh_thread, in_fresh_thread


def test_a_fresh_thread_returns_the_result_and_exits() -> None:
    seen: list[threading.Thread] = []

    def work(x: int, *, y: int) -> int:
        seen.append(threading.current_thread())
        return x + y

    assert call_in_fresh_thread(work, 2, y=3) == 5
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()
    assert asyncio.run(in_fresh_thread(work, 1, y=1)) == 2


def test_a_fresh_thread_hands_its_exception_to_the_caller() -> None:
    def broken() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        call_in_fresh_thread(broken)
