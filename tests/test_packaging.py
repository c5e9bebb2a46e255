"""The distribution's shape: packages listed, typed, licensed, entry points importable."""

import importlib
import importlib.metadata as md
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    mapping = {
        "areal_sdk": "areal_sdk",
        "plugins": "areal_sdk.plugins",
        "backends": "areal_sdk.backends",
    }
    found = set()
    for top, name in mapping.items():
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / top).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), "add these to [tool.setuptools] packages"


def test_layout_license_and_typing():
    for d in ("areal_sdk", "plugins", "backends", "csrc", "examples", "tests"):
        assert (REPO / d).is_dir(), d
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert (REPO / "areal_sdk" / "py.typed").is_file()
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert PYPROJECT["project"]["scripts"]["areal-sdk"] == "areal_sdk.cli:main"


def test_extras_are_declared():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name in (
        "openai",
        "anthropic",
        "langchain",
        "openai-agents",
        "camel",
        "deepspeed",
        "sglang",
        "lora",
        "all",
        "dev",
    ):
        assert extras.get(name), f"extra {name} missing or empty"


def test_every_builtin_entry_point_imports_without_its_framework():
    declared = PYPROJECT["project"]["entry-points"]["areal_sdk"]
    installed = {ep.name: ep.value for ep in md.entry_points(group="areal_sdk")}
    for name, target in declared.items():
        assert installed.get(name) == target, (
            f"entry point {name} not installed (reinstall the package)"
        )
        importlib.import_module(target)
