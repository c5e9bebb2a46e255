"""The supervised engine: a rebuild that a cancelled caller started still completes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest

from areal_sdk.inference import SamplingParams
from areal_sdk.supervisor import SupervisedEngine
from tests.backends.embedded.conftest import make_engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


async def test_a_caller_cancelled_mid_rebuild_does_not_stop_it(tiny_model_dir: Path) -> None:
    built = []

    def factory():  # type: ignore[no-untyped-def]
        if built:
            time.sleep(0.5)  # a rebuild takes a while
        engine = make_engine(tiny_model_dir)
        built.append(engine)
        return engine

    supervised = SupervisedEngine(factory)
    try:

        def crash() -> None:
            raise SystemExit("simulated crash")

        built[0]._step = crash  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await built[0].generate([5, 17, 42], GREEDY)  # the loop dies
        # A request finds the engine dead and starts the rebuild; its client then leaves.
        call = asyncio.create_task(supervised.generate([5, 17, 42], GREEDY))
        await asyncio.sleep(0.2)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        out = await supervised.generate([5, 17, 42], GREEDY)
        assert len(out.output_ids) == 8
        assert supervised.restarts == 1 and len(built) == 2  # one rebuild, not a second
    finally:
        for engine in built:
            await engine.close()


def test_callers_on_two_event_loops_share_one_rebuild(tiny_model_dir: Path) -> None:
    """The gateway's thread and the run's loop both find the engine dead at once: one
    rebuild, and neither caller fails on a lock bound to the other's loop."""
    built = []

    def factory():  # type: ignore[no-untyped-def]
        if built:
            time.sleep(0.5)  # a rebuild takes a while: the second caller waits on it
        engine = make_engine(tiny_model_dir)
        built.append(engine)
        return engine

    supervised = SupervisedEngine(factory)

    def crash() -> None:
        raise SystemExit("simulated crash")

    async def kill() -> None:
        built[0]._step = crash  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await built[0].generate([5, 17, 42], GREEDY)

    asyncio.run(kill())
    outcomes: list[object] = []

    def caller() -> None:
        try:
            outcomes.append(asyncio.run(supervised.generate([5, 17, 42], GREEDY)))
        except Exception as exc:  # recorded, so the assertion names it
            outcomes.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        assert [type(o).__name__ for o in outcomes] == ["GenerateOutput"] * 2, outcomes
        assert supervised.restarts == 1 and len(built) == 2
    finally:
        for engine in built:
            asyncio.run(engine.close())
