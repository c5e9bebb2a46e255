"""A synchronous agent that hangs on some tasks: the hung calls time out alone, and neither
starve later episodes nor keep the process from exiting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import areal_sdk as areal
from areal_sdk.rollout import RolloutController, StoreSessions
from areal_sdk.store import TrajectoryStore


@areal.trace
def hangs_on_every_tenth(task):
    if task["n"] % 10 == 0:
        threading.Event().wait()  # never returns
    return 1.0


def test_hung_sync_calls_do_not_starve_later_episodes(tmp_path):
    store = TrajectoryStore(tmp_path)
    # Two hung calls would fill a pool of two threads: every later episode would time out.
    controller = RolloutController(
        hangs_on_every_tenth, StoreSessions(store), concurrency=2, timeout_s=1
    )
    tasks = [{"id": f"t{n}", "n": n} for n in range(20)]
    summary = asyncio.run(controller.run(tasks))
    assert len(summary.ok) == 18
    assert sorted(e.task_id for e in summary.failed) == ["t0", "t10"]
    assert all("did not finish within 1 s" in e.error for e in summary.failed)
    assert len(store.query()) == 20


def test_a_rollout_with_hung_agents_exits_when_done(tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio, threading
        import areal_sdk as areal
        from areal_sdk.rollout import RolloutController, StoreSessions
        from areal_sdk.store import TrajectoryStore

        @areal.trace
        def agent(task):
            if task["n"] % 10 == 0:
                threading.Event().wait()
            return 1.0

        store = TrajectoryStore({str(tmp_path)!r})
        controller = RolloutController(agent, StoreSessions(store), concurrency=4, timeout_s=1)
        summary = asyncio.run(controller.run([{{"id": str(n), "n": n}} for n in range(10)]))
        store.close()
        print("ok", len(summary.ok), "failed", len(summary.failed))
        """
    )
    # A hang guard, not a timing: the process must end on its own.
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "9", "failed", "1"]
