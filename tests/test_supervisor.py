"""The supervised engine: a rebuild that a cancelled caller started still completes."""

from __future__ import annotations

import asyncio
import contextlib
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
