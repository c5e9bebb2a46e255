import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from areal_sdk.store import StoreError, TrajectoryStore
from areal_sdk.trajectory import Episode, EpisodeStatus, Turn


def ep(task="t", group=None, status=EpisodeStatus.OK, versions=(0,), reward=1.0):
    turns = [
        Turn(
            api="openai.chat",
            prompt_ids=[1],
            completion_ids=[2] * len(versions),
            logprobs=[-0.1] * len(versions),
            versions=list(versions),
        )
    ]
    return Episode(task_id=task, group_id=group, status=status, reward=reward, turns=turns)


def test_append_and_query_by_run_group_status_version(tmp_path):
    store = TrajectoryStore(tmp_path / "run", run_id="r1")
    a, b, c = (
        ep(group="g1", versions=(0, 1)),
        ep(group="g1", status="failed", versions=(2,)),
        ep(group="g2", versions=(3, 4)),
    )
    store.append(a)
    store.append_many([b, c])
    store.append(ep(), run_id="r2")
    assert (tmp_path / "run" / "trajectories.db").is_file()
    assert [e.id for e in store.query(run_id="r1")] == [a.id, b.id, c.id]
    assert [e.id for e in store.query(group_id="g1")] == [a.id, b.id]
    assert [e.id for e in store.query(status="failed")] == [b.id]
    assert [e.id for e in store.query(min_version=2)] == [b.id, c.id]
    assert [e.id for e in store.query(max_version=2, run_id="r1")] == [a.id, b.id]
    assert store.count(run_id="r2") == 1 and store.runs() == ["r1", "r2"]
    assert store.get(c.id) == c


def test_duplicate_episode_is_rejected_and_the_batch_is_atomic(tmp_path):
    store = TrajectoryStore(tmp_path / "s.db")
    first = ep()
    store.append(first)
    with pytest.raises(StoreError, match="already stored"):
        store.append_many([ep(), first])
    assert store.count() == 1


def test_mark_consumed_once(tmp_path):
    store = TrajectoryStore(tmp_path / "s.db")
    a, b = ep(), ep()
    store.append_many([a, b])
    store.mark_consumed([a.id], step=3)
    assert [e.id for e in store.query(consumed=False)] == [b.id]
    assert [e.id for e in store.query(step=3)] == [a.id]
    assert store.consumed_steps() == {a.id: 3}
    with pytest.raises(StoreError, match="already consumed"):
        store.mark_consumed([a.id, b.id], step=4)
    assert store.consumed_steps() == {a.id: 3}  # nothing of the failed call landed
    with pytest.raises(StoreError, match="not stored"):
        store.mark_consumed(["ep-missing"], step=4)


def test_export_jsonl(tmp_path):
    store = TrajectoryStore(tmp_path / "s.db", run_id="r")
    episodes = [ep(task=f"t{i}") for i in range(3)]
    store.append_many(episodes)
    out = io.StringIO()
    assert store.export_jsonl(out) == 3
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["task_id"] for r in rows] == ["t0", "t1", "t2"]
    assert rows[0]["run_id"] == "r" and rows[0]["turns"][0]["completion_ids"] == [2]
    assert (
        Episode.model_validate(
            {k: v for k, v in rows[0].items() if k not in ("run_id", "consumed_step")}
        )
        == episodes[0]
    )


WRITER = textwrap.dedent(
    """
    import sys
    from areal_sdk.store import TrajectoryStore
    from areal_sdk.trajectory import Episode, Turn
    store = TrajectoryStore(sys.argv[1])
    big = list(range(20000))
    i = 0
    while True:
        turn = Turn(api="openai.chat", prompt_ids=big, completion_ids=big, logprobs=[0.0] * len(big), versions=[0] * len(big))
        store.append(Episode(id=f"ep-{i}", task_id=str(i), turns=[turn]))
        print(i, flush=True)  # acknowledged only after append returned
        i += 1
    """
)


def test_sigkill_mid_write_keeps_every_acknowledged_episode(tmp_path):
    db = tmp_path / "killed.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True
    )
    acknowledged = []
    deadline = time.time() + 60
    while len(acknowledged) < 15 and time.time() < deadline:
        acknowledged.append(int(proc.stdout.readline()))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acknowledged += [int(line) for line in proc.stdout.read().split()]
    assert len(acknowledged) >= 15

    # Readable by plain sqlite, and by the store, with every acknowledged episode whole.
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = TrajectoryStore(db)
    stored = {e.id: e for e in store.query()}
    for i in acknowledged:
        assert len(stored[f"ep-{i}"].turns[0].completion_ids) == 20000
