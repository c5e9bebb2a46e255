"""Tasks and agents from config: a JSONL dataset, and ``module:function`` entry points."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from areal_sdk.tracing import trace


class TaskError(ValueError):
    """A dataset or agent entry point that cannot be used; the message says why."""


def load_tasks(
    path: str | Path,
    *,
    id_field: str = "id",
    limit: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Read one JSON object per line. Tasks without ``id_field`` get ``<file>:<line>`` ids."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"data file {path} does not exist")
    tasks: list[dict[str, Any]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise TaskError(f"{path}:{lineno}: a task must be a JSON object")
            row.setdefault(id_field, f"{path.stem}:{lineno}")
            row["id"] = str(row[id_field])
            tasks.append(row)
    if not tasks:
        raise TaskError(f"data file {path} holds no tasks")
    if shuffle:
        random.Random(seed).shuffle(tasks)
    return tasks[:limit] if limit else tasks


SearchPath = Path | Sequence[Path] | None


def _resolve_entry(entry: str, search_path: SearchPath) -> tuple[str, str, list[Path]]:
    """``entry`` split into (module, attribute), with ``search_path`` put first on sys.path."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise TaskError(f"agent.entry must look like 'package.module:function', got {entry!r}")
    paths = [search_path] if isinstance(search_path, Path) else list(search_path or [])
    for path in reversed(paths):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    return module_name, attr, paths


def _forget_shadowing(module_name: str, paths: list[Path]) -> None:
    """Drop an earlier import of the same top-level name from another place (another
    example's ``agent``), so the import finds the module in ``paths``."""
    top = module_name.partition(".")[0]
    loaded = sys.modules.get(top)
    if loaded is None:
        return
    for path in paths:
        spec = importlib.machinery.PathFinder.find_spec(top, [str(path)])
        if spec is None:
            continue
        if spec.origin != getattr(loaded, "__file__", None):
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
        return


def load_agent(entry: str, *, search_path: SearchPath = None) -> Callable[..., Any]:
    """Import ``package.module:function``, looking in ``search_path`` (a directory or several,
    first wins) before ``sys.path``. An undecorated function is traced for the user."""
    module_name, attr, paths = _resolve_entry(entry, search_path)
    _forget_shadowing(module_name, paths)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"cannot import agent module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise TaskError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise TaskError(f"agent.entry {entry!r} is not callable")
    if not hasattr(fn, "__areal_trace__"):
        fn = trace(fn)
    return fn


def check_agent_entry(entry: str, *, search_path: SearchPath = None) -> None:
    """Fail fast, without importing it, when ``entry``'s module cannot be found."""
    module_name, _, paths = _resolve_entry(entry, search_path)
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a missing parent package
        found = False
    if not found:
        where = ", ".join(str(p) for p in paths) or "sys.path"
        raise TaskError(
            f"cannot find agent module {module_name!r} (looked in {where} and sys.path)"
        )


def is_async_agent(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)
