"""The malloc settings: memory freed on a worker thread goes back to the system."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Run in a fresh interpreter: in a long test session the arenas already hold free holes from
# earlier tests, so where a new block lands (and whether glibc trims it on its own) depends
# on test order.
_SCENARIO = r"""
import json, threading
from pathlib import Path
import torch
from areal_sdk.malloc import release_free_memory

def rss_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

kept = []
def step():
    # A freed 16 MiB block raises glibc's mmap threshold, so the 1 MiB tensors after it
    # come from this thread's arena, as a training step's activations do; a tensor that
    # outlives the step sits above them, so the arena cannot simply shrink.
    big = torch.ones(4 << 20)
    del big
    tensors = [torch.ones(256 << 10) for _ in range(512)]  # 512 MiB, touched
    kept.append(torch.ones(1024))
    del tensors

before = rss_mib()
worker = threading.Thread(target=step)
worker.start()
worker.join()
held = rss_mib()
released = release_free_memory()
print(json.dumps({"before": before, "held": held, "after": rss_mib(), "released": released}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_memory_freed_by_a_worker_thread_is_released() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    rss = json.loads(out.strip().splitlines()[-1])
    # Without the release the freed step stays resident in the worker's arena ...
    assert rss["held"] > rss["before"] + 256, rss
    # ... and release_free_memory hands it back.
    assert rss["released"], rss
    assert rss["after"] < rss["held"] - 256, rss
