"""The services' tests run a real gateway over the tiny embedded engine (tests/gateway)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import engine, gateway  # noqa: F401 - fixtures
from tests.plugins.conftest import ROUTING_ENV
from tests.training.conftest import run_config  # noqa: F401 - fixture


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROUTING_ENV:
        monkeypatch.delenv(name, raising=False)


def small_ray_run(
    make_config: Callable[..., Path], *, run: dict[str, Any] | None = None, **ray: Any
) -> Path:
    """A two-step run whose Ray services fit two cores (an engine server, one rollout worker,
    one trainer rank), written by ``make_config`` (the ``run_config`` fixture); ``ray`` adds
    keys of the ``ray:`` section (``address=...``)."""
    return make_config(
        run={"steps": 2, "heartbeat_timeout_s": 5.0, **(run or {})},
        ray={
            "engine": {"num_cpus": 1},
            "worker": {"num_cpus": 0.5},
            "trainer": {"num_cpus": 0.5},
            **ray,
        },
        rollout={"workers": 1, "timeout_s": 60},
        eval={"before": False, "after": False},
    )
