"""docs/api.md covers the whole public API: every name ``import vitcam_nb as vc`` exports, and every name a public
submodule (``vc.evaluate``, ``vc.targets``, ``vc.presets``, ...) exports, has a reference entry."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import vitcam_nb as vc

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ENTRIES = re.findall(r"^::: ([\w.]+)$", API.read_text(), flags=re.M)


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _exports(module) -> set[str]:
    """What a module offers: its ``__all__``, or the public names it defines itself."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, o in vars(module).items()
                 if not n.startswith("_") and getattr(o, "__module__", None) == module.__name__]
    return {n for n in names if not n.startswith("_")}


def _shadowed(module, name: str) -> bool:
    """A name that is also a submodule's (``vc.evaluate.scorecard``): the reference generator documents the
    submodule there, so the function needs an entry of its own."""
    return importlib.util.find_spec(f"{module.__name__}.{name}") is not None if hasattr(module, "__path__") else False


def _documented() -> tuple[set[int], set[str]]:
    objects, modules = set(), set()
    for entry in ENTRIES:
        obj = _resolve(entry)
        if inspect.ismodule(obj):
            modules.add(obj.__name__)
            objects |= {id(getattr(obj, n)) for n in _exports(obj) if not _shadowed(obj, n)}
        objects.add(id(obj))
    return objects, modules


def test_every_entry_resolves():
    assert ENTRIES
    for entry in ENTRIES:
        _resolve(entry)


def test_every_public_name_has_a_reference_entry():
    objects, modules = _documented()
    missing = []
    for name in sorted(set(vc.__all__) - {"__version__"}):
        obj = getattr(vc, name)
        if inspect.ismodule(obj):
            missing += [f"vc.{name}.{n}" for n in sorted(_exports(obj))
                        if id(getattr(obj, n)) not in objects and callable(getattr(obj, n))]
        elif id(obj) not in objects:
            missing.append(f"vc.{name}")
    assert not missing, f"add these to docs/api.md: {missing}"


@pytest.mark.parametrize("name", ["evaluate", "targets", "presets", "interop", "adapters", "stages", "plot"])
def test_public_submodules_are_documented_whole(name):
    _, modules = _documented()
    assert getattr(vc, name).__name__ in modules


def test_the_navigation_lists_the_evaluation_page():
    nav = (API.parents[1] / "mkdocs.yml").read_text().split("\nnav:")[1]
    assert "evaluation.md" in nav and "api.md" in nav
