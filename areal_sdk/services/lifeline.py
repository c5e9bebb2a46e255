"""A child process that dies with its parent, however the parent dies (``kill -9`` included).

The one mechanism by which every service dies with the run: the engine servers and the
gateway get a lifeline (``--lifeline FD``); a rollout worker's socket to the run is its
lifeline in the same way (EOF once the run is gone).

The parent keeps the write end of a pipe and hands the read end to the child
(``Popen(pass_fds=...)``); the child reads it on a thread of its own, and the read returns
only when every write end is closed, which the kernel does when the parent exits. Unlike
``prctl(PR_SET_PDEATHSIG)``, which fires when the *thread* that forked the child exits, this
follows the parent process, and works beyond Linux.

>>> line = Lifeline()                                              # parent  # doctest: +SKIP
>>> Popen([..., "--lifeline", str(line.child_fd)], pass_fds=(line.child_fd,))
>>> line.spawned()                           # the parent's copy of the read end is closed
>>> exit_with_parent(args.lifeline)                                # child, first thing
"""

from __future__ import annotations

import os
import sys
import threading


class Lifeline:
    """One pipe per child: ``child_fd`` goes to the child, the parent holds the write end
    until ``close`` (or until it dies)."""

    def __init__(self) -> None:
        # os.pipe() fds are not inherited by other children; pass_fds passes the read end.
        self.child_fd, self._write_fd = os.pipe()

    def spawned(self) -> None:
        """Close the parent's copy of the read end, once the child has its own."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def close(self) -> None:
        """Cut the line: the child exits as if the parent had died."""
        self.spawned()
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1


def exit_with_parent(fd: int, *, name: str = "service") -> None:
    """In the child: exit at once when the parent holding ``fd``'s write end is gone."""

    def wait() -> None:
        try:
            while os.read(fd, 1):  # the parent never writes: this returns at EOF
                pass
        except OSError:
            pass
        print(f"{name}: the parent process is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=wait, name="areal-lifeline", daemon=True).start()
