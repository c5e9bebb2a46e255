"""Which finished groups a step trains: the oldest policy version first, so groups that
finish out of order are trained before they go stale."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from areal_sdk.config import load_config
from areal_sdk.trainer import AsyncTrainer, Group
from areal_sdk.trajectory import Episode, EpisodeStatus


def group(name: str, start_version: int) -> Group:
    episodes = [
        Episode(
            task_id=name,
            group_id=name,
            status=EpisodeStatus.OK,
            reward=float(i),
            metadata={"start_version": start_version},
        )
        for i in range(2)
    ]
    return Group(name, episodes)


def trainer(max_staleness: int) -> AsyncTrainer:
    cfg = load_config(
        None,
        [
            "rollout.group_size=2",
            "rollout.batch_size=2",  # one group per step
            f"rollout.max_staleness={max_staleness}",
            "algorithm.dynamic_filter=false",
        ],
    )
    # _next_groups reads only the buffer and the staleness bound: the collaborators that
    # run rollouts, store episodes and push weights are never called here.
    return AsyncTrainer(
        cfg,
        backend=SimpleNamespace(version=3, step=3),  # type: ignore[arg-type]
        controller=None,  # type: ignore[arg-type]
        push_weights=None,  # type: ignore[arg-type]
        store=None,  # type: ignore[arg-type]
        run_dir=None,  # type: ignore[arg-type]
        log=lambda step, metrics: None,
    )


async def test_a_late_group_from_an_older_version_trains_before_it_goes_stale() -> None:
    t = trainer(max_staleness=1)
    t.buffer.put(group("fresh", start_version=3))  # finished first
    t.buffer.put(group("old", start_version=2))  # a long reply, finished second
    # First-finished-first would train "fresh" at step 3, then drop "old" (4 - 2 > 1) and
    # wait at step 4 for a group that never comes.
    first, drops = await asyncio.wait_for(t._next_groups(3), 5)
    second, later_drops = await asyncio.wait_for(t._next_groups(4), 5)
    assert [g.group_id for g in first + second] == ["old", "fresh"]
    assert drops["rollout/dropped_stale_groups"] == later_drops["rollout/dropped_stale_groups"] == 0


async def test_groups_of_one_version_train_in_the_order_they_finished() -> None:
    t = trainer(max_staleness=2)
    for name in ("a", "b", "c"):
        t.buffer.put(group(name, start_version=3))
    order = [(await t._next_groups(3))[0][0].group_id for _ in range(3)]
    assert order == ["a", "b", "c"]
