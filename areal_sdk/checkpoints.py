"""Training checkpoints in ``run.dir/checkpoints/step-N``: written whole or not at all.

A checkpoint is the train backend's ``save`` output plus ``trainer_state.json``. It is
written under a temporary name and renamed into place, so ``latest()`` never returns a
half-written one after a crash.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from areal_sdk.train_backend import TrainBackend

TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    version: int
    path: Path


class Checkpoints:
    """The checkpoints of one run, newest kept."""

    def __init__(self, run_dir: str | Path, *, keep: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def all(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first."""
        found = []
        if not self.root.is_dir():
            return found
        for child in self.root.iterdir():
            match = _STEP_DIR.fullmatch(child.name)
            state = child / TRAINER_STATE
            if match is None or not state.is_file():
                continue
            data = json.loads(state.read_text())
            found.append(Checkpoint(int(data["step"]), int(data["version"]), child))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        every = self.all()
        return every[-1] if every else None

    def save(self, backend: TrainBackend) -> Checkpoint:
        """Write the backend's state as ``step-<backend.step>`` and prune older ones."""
        step = backend.step
        final = self.root / f"step-{step}"
        staging = self.root / f".step-{step}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        backend.save(staging)
        if backend.rank == 0:
            state = {"step": step, "version": backend.version}
            (staging / TRAINER_STATE).write_text(json.dumps(state))
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            for old in self.all()[: -self.keep]:
                shutil.rmtree(old.path, ignore_errors=True)
        return Checkpoint(step, backend.version, final)
