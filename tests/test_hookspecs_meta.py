"""Keep the extension surface honest: every hookspec is documented and tested."""

import inspect
from pathlib import Path

import pytest

from areal_sdk import hookspecs

TESTS = Path(__file__).parent
DOCS = Path(__file__).parent.parent / "docs" / "plugins.md"


def hook_names():
    return sorted(
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("areal_") and hasattr(fn, "areal_sdk_spec")
    )


def test_there_are_hooks():
    assert len(hook_names()) >= 12


@pytest.mark.parametrize("name", hook_names())
def test_hookspec_has_a_docstring_saying_when_and_what(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert len(doc) > 60, f"hookspec {name} needs a docstring: when it runs, what it gets, returns"


@pytest.mark.parametrize("name", hook_names())
def test_hookspec_has_a_test(name):
    sources = [p.read_text() for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name]
    assert any(name in text for text in sources), f"no test mentions hook {name}"


@pytest.mark.parametrize("name", hook_names())
def test_hookspec_is_in_the_plugin_guide(name):
    assert name in DOCS.read_text(), f"docs/plugins.md does not document {name}"


def test_every_hook_is_reachable_through_the_facade():
    source = inspect.getsource(__import__("areal_sdk.plugin_host", fromlist=["x"]))
    for name in hook_names():
        assert f'"{name}"' in source, f"PluginHost has no typed method calling {name}"
