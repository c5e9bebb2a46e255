"""``model.dtype`` as the embedded engine runs it on the machine at hand."""

from __future__ import annotations

import logging

import pytest
from areal_sdk.backends.embedded import plugin
from areal_sdk.backends.train import torch_backend


def test_bfloat16_on_a_cpu_without_native_bf16_runs_in_float32(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch_backend, "bf16_runs_fast", lambda device: False)
    with caplog.at_level(logging.WARNING):
        assert plugin._dtype_that_runs("bfloat16", "cpu") == "float32"
    assert "no native bfloat16" in caplog.text
    assert plugin._dtype_that_runs("auto", "cpu") == "auto"


def test_bfloat16_stays_where_it_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "bf16_runs_fast", lambda device: True)
    assert plugin._dtype_that_runs("bfloat16", "cpu") == "bfloat16"
