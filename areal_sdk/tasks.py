"""Tasks and agents from config: a JSONL dataset, and ``module:function`` entry points."""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import random
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
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
# User modules load under this prefix, so a file named like an installed package (agents.py,
# langchain.py) never takes that package's place in sys.modules.
PRIVATE_PREFIX = "_areal_agent_"


def _search_dirs(search_path: SearchPath) -> list[Path]:
    return [search_path] if isinstance(search_path, Path) else list(search_path or [])


def _user_module_root(top: str, dirs: list[Path]) -> Path | None:
    """The file or package directory named ``top`` in the first of ``dirs`` that has one."""
    for base in dirs:
        if (base / f"{top}.py").is_file():
            return base / f"{top}.py"
        if (base / top).is_dir():
            return base / top
    return None


def _import_private(module_name: str, root: Path) -> ModuleType:
    """Import ``module_name`` (``pkg.sub.mod`` or ``mod``), found at ``root``, under a private
    top-level name. Its directory goes last on sys.path, so its own sibling imports still
    resolve, but never ahead of an installed package of the same name."""
    top, _, rest = module_name.partition(".")
    digest = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    alias = f"{PRIVATE_PREFIX}{digest}_{top}"
    if str(root.parent) not in sys.path:
        sys.path.append(str(root.parent))
    if alias not in sys.modules:
        if root.is_file() and rest:
            raise ModuleNotFoundError(f"{top!r} is a module, not a package", name=module_name)
        init = root / "__init__.py"
        if root.is_file():
            spec = importlib.util.spec_from_file_location(alias, root)
        elif init.is_file():
            spec = importlib.util.spec_from_file_location(
                alias, init, submodule_search_locations=[str(root)]
            )
        else:  # a directory without __init__.py: a namespace package
            spec = importlib.machinery.ModuleSpec(alias, None, is_package=True)
            spec.submodule_search_locations = [str(root)]
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        try:
            if spec.loader is not None:
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[alias]
            raise
    return importlib.import_module(f"{alias}.{rest}" if rest else alias)


def _import_failure(module_name: str, exc: BaseException) -> TaskError:
    """A ``TaskError`` for an agent module that raised while importing, naming the extra to
    install when what it lacks is a framework areal-sdk has one for."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        from areal_sdk.plugin_host import extra_for_module

        if exc.name.startswith(PRIVATE_PREFIX) or exc.name == module_name:
            return TaskError(f"cannot find agent module {module_name!r}: {exc}")

        extra = extra_for_module(exc.name)
        fix = f': pip install "areal-sdk[{extra}]"' if extra else ""
        return TaskError(
            f"agent module {module_name!r} imports {exc.name!r}, which is not installed{fix}"
        )
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return TaskError(
        f"importing agent module {module_name!r} failed: {type(exc).__name__}: {exc}{where}"
    )


def load_agent(entry: str, *, search_path: SearchPath = None) -> Callable[..., Any]:
    """Import ``package.module:function``, looking in ``search_path`` (a directory or several,
    first wins) before the installed packages. An undecorated function is traced for the user.

    A module found in ``search_path`` is imported under a private name (see
    ``_import_private``): an ``agents.py`` beside the config does not hide the OpenAI Agents
    SDK from the adapters. Any failure is a ``TaskError`` that says what to fix.
    """
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise TaskError(f"agent.entry must look like 'package.module:function', got {entry!r}")
    dirs = _search_dirs(search_path)
    root = _user_module_root(module_name.partition(".")[0], dirs)
    try:
        if root is not None:
            module = _import_private(module_name, root)
        elif importlib.util.find_spec(module_name.partition(".")[0]) is None:
            where = ", ".join([*(str(p) for p in dirs), "the installed packages"])
            raise TaskError(f"cannot find agent module {module_name!r} (looked in {where})")
        else:
            module = importlib.import_module(module_name)
    except TaskError:
        raise
    except Exception as exc:  # the user's module failed at import: say where, not a traceback
        raise _import_failure(module_name, exc) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise TaskError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise TaskError(f"agent.entry {entry!r} is not callable")
    if not hasattr(fn, "__areal_trace__"):
        fn = trace(fn)
    return fn


def is_async_agent(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)
