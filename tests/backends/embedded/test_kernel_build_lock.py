"""The CPU kernels' build never waits forever on a lock that a killed build left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from areal_sdk.backends.embedded import cpu_kernels

pytest.importorskip("fcntl")


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()  # torch's build lock, as a build killed midway leaves it
    with cpu_kernels._exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_running_build_keeps_its_lock(tmp_path: Path) -> None:
    """A build in another process holds the advisory lock: its ``lock`` file is not stale,
    and a second build waits for it rather than removing it."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from pathlib import Path
                from areal_sdk.backends.embedded import cpu_kernels
                with cpu_kernels._exclusive_build(Path({str(tmp_path)!r})):
                    (Path({str(tmp_path)!r}) / "lock").touch()
                    print("building", flush=True)
                    sys.stdin.readline()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "building"
        import fcntl

        with open(tmp_path / ".areal-build.flock", "w") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (tmp_path / "lock").exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)


@pytest.mark.slow
def test_the_engine_builds_its_kernels_past_a_stale_lock(tmp_path: Path) -> None:
    """The real build, in a fresh extension directory that holds a killed build's lock."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    probe = "from torch.utils.cpp_extension import _get_build_directory as d; "
    name = cpu_kernels._build_name()
    build_dir = subprocess.run(
        [sys.executable, "-c", probe + f"print(d({name!r}, False))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert build_dir.startswith(str(tmp_path))
    (Path(build_dir) / "lock").touch()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from areal_sdk.backends.embedded import cpu_kernels; print(cpu_kernels.available())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.stdout.strip() == "True", proc.stderr
