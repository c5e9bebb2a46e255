"""A service process dies with its supervisor, even one killed with ``kill -9``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The supervisor: starts a child that calls exit_with_parent(), from its main thread or from
# another thread, prints the child's pid and waits to be killed.
PARENT = """
import os, subprocess, sys, threading, time
from areal_sdk.services.orphan import child_env

CHILD = "from areal_sdk.services.orphan import exit_with_parent; exit_with_parent(); " \\
    "print('ready', flush=True); import time; time.sleep(120)"

def spawn():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], env={**os.environ, **child_env()},
        stdout=subprocess.PIPE, text=True,
    )
    child.stdout.readline()
    print(child.pid, flush=True)

if sys.argv[1] == "thread":
    t = threading.Thread(target=spawn)
    t.start()
    t.join()  # the launching thread ends: the child must live on while the parent does
    time.sleep(2)
    print("still", flush=True)
else:
    spawn()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_child_dies_with_a_killed_parent(launched_from: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, launched_from], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        if launched_from == "thread":
            assert parent.stdout.readline().strip() == "still" and _alive(child)
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait(10)
