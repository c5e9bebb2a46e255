"""``run.placement=ray`` with no cluster to join: the run starts a local one, and that
cluster lives as long as the run, whichever thread connected. (The run builds its trainer,
and so connects, on a thread that ends right after; Ray's head processes die with the thread
that started them unless the run keeps that thread.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytest.importorskip("ray")

SCRIPT = textwrap.dedent(
    """
    import threading, time
    import ray
    from areal_sdk.config import load_config
    from areal_sdk.services.ray_placement import RayPlacement

    cfg = load_config(None, ["run.placement=ray", "ray.worker.num_cpus=1"])
    placement = RayPlacement(cfg)
    failed = []

    def connect():
        try:
            placement.connect(engines=0, workers=1)
        except BaseException as exc:
            failed.append(exc)

    connecting = threading.Thread(target=connect)
    connecting.start()
    connecting.join()  # the thread that started the cluster is gone now
    assert not failed, failed
    time.sleep(3)

    @ray.remote(num_cpus=0)
    def answer():
        return 42

    print("answer", ray.get(answer.remote(), timeout=30))
    placement.close()
    """
)


@pytest.mark.slow
def test_a_local_cluster_outlives_the_thread_that_started_it(tmp_path) -> None:
    # No `ray start` recorded under this directory: a local cluster. Short, for Ray's sockets.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = ray_tmp
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "answer 42" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_areal_sdk_train_on_ray_with_no_cluster_runs_on_a_local_one(run_config, monkeypatch):
    from tests.services.conftest import small_ray_run
    from tests.services.test_processes_run import LiveRun, _assert_trained_once

    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)  # no `ray start` recorded there
    config = small_ray_run(run_config, run={"placement": "ray"})
    try:
        run = LiveRun(config)
        assert run.finish() == 0, run.output
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    _assert_trained_once(run.run_dir, 2)
    assert "connecting to the local Ray cluster" in run.output, run.output
