"""The layered architecture of docs/architecture.md, enforced: import-linter's contracts, no private names
imported across modules, no import cycle, one capture pass, small single-purpose modules.

The import graph here is built from the source with ``ast`` (function-level imports included), independently
of import-linter's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vitcam_nb"
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported from, name imported or None, line) for every import statement of a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(base, alias.name, node.lineno) for alias in node.names]
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> package modules it imports (a ``from package import submodule`` names the submodule)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for base, imported, _ in _imports(name, path):
            full = f"{base}.{imported}" if imported else base
            target = full if full in MODULES else base if base in MODULES else None
            if target and target != name:
                edges[name].add(target)
    return edges


def strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in reverse topological order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def test_tarjan_finds_a_known_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    components = strongly_connected_components(edges)
    assert sorted(c for c in components if len(c) > 1) == [["a", "b", "c"]]
    assert len(components) == 3


def test_the_import_graph_has_no_cycle():
    cycles = [c for c in strongly_connected_components(_graph()) if len(c) > 1]
    assert cycles == []


def test_no_private_name_is_imported_across_modules():
    bad = []
    for name, path in MODULES.items():
        for base, imported, line in _imports(name, path):
            if not base.startswith("vitcam_nb"):
                continue
            private_name = imported is not None and imported.startswith("_") and not imported.startswith("__")
            # A private module (e.g. evaluate._common) serves its own package only.
            private_module = next((p for p in base.split(".") if p.startswith("_")), None)
            owner = base.rpartition(".")[0]
            outsider = private_module is not None and name != owner and not name.startswith(owner + ".")
            if private_name or outsider:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported or ''} from {base}")
    assert bad == []


def test_no_module_looks_up_the_package_in_sys_modules():
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "modules" and isinstance(node.value.value, ast.Name) \
                    and node.value.value.id == "sys":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_every_module_belongs_to_exactly_one_layer():
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    members = [{m.strip() for m in layer.replace("|", ":").split(":")} for layer in layers]
    top = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    for part in sorted(top):
        owners = [i for i, layer in enumerate(members) if f"vitcam_nb.{part}" in layer]
        assert len(owners) == 1, f"vitcam_nb.{part} is in layers {owners} of the import-linter contract"


def test_lint_imports_keeps_every_contract():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports is not installed: pip install -e '.[test]' installs import-linter")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(_contracts())} kept, 0 broken" in proc.stdout


def test_torch_autograd_grad_is_called_in_one_place():
    calls = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "grad" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "autograd":
                calls.append(name)
    assert calls == ["vitcam_nb.capture.backward"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_are_small_and_say_what_they_do(name):
    path = MODULES[name]
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{path.relative_to(ROOT)} has no module docstring"
    assert "DESIGN.md" not in path.read_text()


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.endswith("__main__")))
def test_public_functions_and_classes_show_an_example(name):
    module = importlib.import_module(name)
    public = getattr(module, "__all__", None)
    if public is None:
        public = [n for n in vars(module) if not n.startswith("_")]
    missing = []
    for attr in public:
        obj = getattr(module, attr)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == name \
                and "Example" not in (inspect.getdoc(obj) or ""):
            missing.append(attr)
    assert missing == [], f"{name}: no docstring example for {missing}"
