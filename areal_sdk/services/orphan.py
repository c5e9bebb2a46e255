"""End a service process when the process that supervises it dies.

A supervisor starts each service with ``child_env()`` in its environment; the service calls
``exit_with_parent()`` first thing. Two guards, because neither covers every case alone:

- ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux): the kernel kills the child the instant its
  parent dies, even if the child is stuck in native code. It fires when the *thread* that
  started the child ends, so the supervisor asks for it only when it launches from its main
  thread (``child_env(pdeathsig=...)``).
- a daemon thread that checks once a second whether the child was re-parented (its parent
  died), for every platform and every launching thread.

The supervisor's own ``stop()`` and ``atexit`` hook end its children in a normal exit; these
guards cover a parent killed with ``kill -9``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_PID_ENV = "AREAL_SDK_PARENT_PID"
PDEATHSIG_ENV = "AREAL_SDK_PDEATHSIG"
_PR_SET_PDEATHSIG = 1
CHECK_EVERY_S = 1.0


def child_env(*, pdeathsig: bool | None = None) -> dict[str, str]:
    """Variables for a child that must not outlive this process. ``pdeathsig`` defaults to
    whether the caller is the main thread (see the module docstring)."""
    if pdeathsig is None:
        pdeathsig = threading.current_thread() is threading.main_thread()
    return {PARENT_PID_ENV: str(os.getpid()), PDEATHSIG_ENV: "1" if pdeathsig else "0"}


def exit_with_parent() -> None:
    """If a supervisor started this process, die with it. A no-op otherwise."""
    raw = os.environ.pop(PARENT_PID_ENV, None)  # popped: our own children do not inherit it
    pdeathsig = os.environ.pop(PDEATHSIG_ENV, "0") == "1"
    if not raw:
        return
    parent = int(raw)
    if pdeathsig and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the guard was set
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(CHECK_EVERY_S)
            if os.getppid() != parent:
                os._exit(1)  # nothing to save: the engine's state dies with the run

    threading.Thread(target=watch, name="areal-parent-watch", daemon=True).start()
