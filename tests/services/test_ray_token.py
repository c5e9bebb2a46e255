"""Clusters that ask for Ray's authentication token. ``ray start --head`` turns token
authentication on wherever a token exists (``~/.ray/auth_token``, which any earlier local
``ray.init`` writes, or ``RAY_AUTH_TOKEN_PATH``); a driver given the head's address must then
present the token, which Ray does not do by itself for an explicit address."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from areal_sdk.services.ray_placement import free_port
from tests.services.conftest import small_ray_run
from tests.services.test_processes_run import LiveRun, _assert_trained_once

RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def _wait_listening(port: int, head: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, head.stdout.read() if head.stdout else "ray start exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"ray start --head did not listen on {port} within {timeout_s:g} s")


@pytest.fixture(params=["token", "disabled"])
def head(request, tmp_path, monkeypatch):
    """``ray start --head`` on this machine with a token where Ray looks for one, either left
    to Ray's default (token authentication on) or with ``RAY_AUTH_MODE=disabled``; this
    test's environment holds the same token path and no authentication mode."""
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short, for Ray's socket paths
    for name in RAY_AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    env = dict(os.environ)
    if request.param == "disabled":
        env["RAY_AUTH_MODE"] = "disabled"
    port = free_port("127.0.0.1")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    process = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_tmp}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its GCS and raylet go with its group at the end
    )  # fmt: skip
    try:
        _wait_listening(port, process)
        yield request.param, f"127.0.0.1:{port}"
    finally:
        group = os.getpgid(process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            process.wait(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_joins_a_head_with_or_without_token_authentication(run_config, head):
    _, address = head
    config = small_ray_run(run_config, run={"placement": "ray"}, address=address)
    run = LiveRun(config)
    assert run.finish() == 0, run.output
    _assert_trained_once(run.run_dir, 2)
    assert f"connecting to {address}" in run.output, run.output


@pytest.mark.slow
@pytest.mark.parametrize("head", ["token"], indirect=True)
def test_a_head_asking_for_a_token_this_machine_lacks_fails_at_once(head, tmp_path, monkeypatch):
    from areal_sdk.config import load_config
    from areal_sdk.launcher import LaunchError
    from areal_sdk.services.ray_placement import RayPlacement

    _, address = head
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token-here"))
    cfg = load_config(None, ["run.placement=ray", f"ray.address={address}"])
    started = time.monotonic()
    with pytest.raises(LaunchError, match="token authentication.*RAY_AUTH_TOKEN"):
        RayPlacement(cfg).connect(engines=1, workers=1)
    assert time.monotonic() - started < 15  # not Ray's 20 s of retries
