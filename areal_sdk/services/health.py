"""What every supervised service shares: its observed state, its restart budget, and the
error that stops a run when a service keeps failing.

The failure policy is data, as in an OTP supervisor: ``RestartPolicy(max_restarts=3,
window_s=300)`` allows three restarts in any five minutes; the fourth failure inside the
window raises ``ServiceFailed``, which stops the run with one ``error:`` line naming the
service. Each service object (an engine server, the gateway, a rollout worker) keeps a
``ServiceState`` that the progress display, ``/metrics`` and ``areal-sdk status`` read.

>>> policy = RestartPolicy(max_restarts=3, window_s=300)
>>> state = ServiceState(kind="engine", name="engine-0")
>>> policy.record_failure(state, "exit code -9")   # raises ServiceFailed on the 4th in 5 min
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

# A service that has neither answered nor beaten its heartbeat for this long is stalled.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0


class ServiceKind(StrEnum):
    ENGINE = "engine"
    GATEWAY = "gateway"
    ROLLOUT_WORKER = "rollout_worker"
    TRAINER = "trainer"


class Phase(StrEnum):
    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    FAILED = "failed"  # gave up: the run stops
    STOPPED = "stopped"  # removed or shut down on purpose


class ServiceFailed(RuntimeError):
    """A service died or stalled more often than its restart policy allows, or died where
    no restart can help (the trainer). The message is the run's one ``error:`` line."""

    def __init__(self, service: str, message: str) -> None:
        super().__init__(message)
        self.service = service


@dataclass
class ServiceState:
    """One service as the supervisor last saw it."""

    kind: str
    name: str
    phase: Phase = Phase.STARTING
    pid: int | None = None
    url: str | None = None
    restarts: int = 0
    last_error: str = ""
    since: float = field(default_factory=time.time)  # when it entered ``phase``
    failures: deque[float] = field(default_factory=deque, repr=False)  # monotonic times

    def enter(self, phase: Phase, error: str | None = None) -> None:
        if phase != self.phase:
            self.phase, self.since = phase, time.time()
        if error is not None:
            self.last_error = error[:500]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("failures")
        out["phase"] = str(self.phase)
        return out


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts of one service in any ``window_s`` seconds."""

    max_restarts: int = 3
    window_s: float = 300.0

    def record_failure(self, state: ServiceState, error: str) -> None:
        """Count one failure of ``state``'s service; raise ``ServiceFailed`` when a restart
        would exceed the budget, else mark it restarting (the caller restarts it)."""
        now = time.monotonic()
        state.failures.append(now)
        while state.failures and now - state.failures[0] > self.window_s:
            state.failures.popleft()
        if len(state.failures) > self.max_restarts:
            state.enter(Phase.FAILED, error)
            raise ServiceFailed(
                state.name,
                f"{state.kind} {state.name} failed {len(state.failures)} times in "
                f"{self.window_s:g} s (last: {error}); stopping the run",
            )
        state.restarts += 1
        state.enter(Phase.RESTARTING, error)


def count_up(states: list[ServiceState]) -> dict[str, tuple[int, int]]:
    """Service kind -> (services up, services wanted), for the progress line."""
    out: dict[str, tuple[int, int]] = {}
    for s in states:
        if s.phase == Phase.STOPPED:
            continue
        up, wanted = out.get(s.kind, (0, 0))
        out[s.kind] = (up + (s.phase == Phase.UP), wanted + 1)
    return out
