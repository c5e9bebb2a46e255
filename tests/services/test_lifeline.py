"""A service process dies with its supervisor, even one killed with ``kill -9``, whichever of
the supervisor's threads launched it (services/lifeline.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The supervisor: starts a child that holds the read end of a lifeline, from its main thread
# or from another thread, prints the child's pid and waits to be killed.
PARENT = """
import subprocess, sys, threading, time
from areal_sdk.services.lifeline import Lifeline

CHILD = "import sys; from areal_sdk.services.lifeline import exit_with_parent; " \\
    "exit_with_parent(int(sys.argv[1])); print('ready', flush=True); import time; time.sleep(120)"

def spawn():
    line = Lifeline()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(line.child_fd)], pass_fds=(line.child_fd,),
        stdout=subprocess.PIPE, text=True,
    )
    line.spawned()
    child.stdout.readline()
    print(child.pid, flush=True)
    spawn.line = line  # held for as long as the parent lives

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
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


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
