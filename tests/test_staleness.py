import asyncio

import pytest

from areal_sdk.staleness import StalenessController


def test_capacity_rule_by_hand():
    # batch 4, staleness 1: (1 + 0 + 1) * 4 = 8 episodes may start under version 0
    sc = StalenessController(batch_size=4, max_staleness=1)
    assert sc.capacity() == 8

    async def fill():
        return [await sc.acquire() for _ in range(8)]

    assert asyncio.run(fill()) == [0] * 8
    assert sc.capacity() == 0
    asyncio.run(sc.set_version(1))
    assert sc.capacity() == 4  # (1 + 1 + 1) * 4 - 8
    asyncio.run(sc.give_back(2))
    assert sc.capacity() == 6


def test_synchronous_baseline_admits_one_batch_per_version():
    async def main():
        sc = StalenessController(batch_size=2, max_staleness=0)
        got = [await sc.acquire(), await sc.acquire()]
        third = asyncio.create_task(sc.acquire())
        await asyncio.sleep(0.05)
        assert not third.done()  # blocked until the trainer advances
        await sc.set_version(1)
        got.append(await asyncio.wait_for(third, 1))
        return got

    assert asyncio.run(main()) == [0, 0, 1]


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_admitted_episodes_never_exceed_the_bound_when_trained(max_staleness):
    """Simulate producer and trainer: every trained episode satisfies t - v <= bound."""

    async def main():
        batch = 3
        sc = StalenessController(batch_size=batch, max_staleness=max_staleness)
        queue: asyncio.Queue[int] = asyncio.Queue()

        async def producer():
            while True:
                v = await sc.acquire()
                await asyncio.sleep(0)
                queue.put_nowait(v)

        tasks = [asyncio.create_task(producer()) for _ in range(5)]
        worst = 0
        for step in range(10):
            versions = [await queue.get() for _ in range(batch)]
            worst = max(worst, max(step - v for v in versions))
            assert all(sc.is_fresh(v, step) for v in versions)
            await sc.set_version(step + 1)
        for t in tasks:
            t.cancel()
        return worst

    assert asyncio.run(main()) <= max_staleness
