"""The services' tests run a real gateway over the tiny embedded engine (tests/gateway)."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import engine, gateway  # noqa: F401 - fixtures
from tests.plugins.conftest import ROUTING_ENV
from tests.training.conftest import run_config  # noqa: F401 - fixture


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ROUTING_ENV:
        monkeypatch.delenv(name, raising=False)
