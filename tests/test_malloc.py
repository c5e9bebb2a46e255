"""The malloc settings: memory freed on a worker thread goes back to the system."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from areal_sdk.malloc import release_free_memory


def _rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_memory_freed_by_a_worker_thread_is_released() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        # A freed 16 MiB block raises glibc's mmap threshold, so the 1 MiB tensors after it
        # come from this thread's arena, as a training step's activations do; a tensor that
        # outlives the step sits above them, so the arena cannot simply shrink.
        big = torch.ones(4 << 20)
        del big
        tensors = [torch.ones(256 << 10) for _ in range(512)]  # 512 MiB, touched
        kept.append(torch.ones(1024))
        del tensors

    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    held = _rss_mib()
    assert release_free_memory()
    assert _rss_mib() < held - 256
