"""The tutorial notebooks executed once per test session, shared by the notebook tests (each notebook runs without
error) and the documentation site's build (which would otherwise execute every notebook a second time).

Each notebook is run by ``scripts/notebooks.py`` (a fresh kernel in a temporary folder, headless, the stored
outputs cleaned as the site shows them) and written to the session's folder; one that fails is not written, and
its error is kept for its own test to report.
"""

from __future__ import annotations

import importlib.util
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@dataclass
class ExecutedNotebooks:
    """The folder the executed notebooks are in (``notebooks/<name>.ipynb``) and each failed one's error."""

    folder: Path
    errors: dict[str, str]


def notebook_runner():
    """``scripts/notebooks.py`` (a script of this checkout, not part of the package)."""
    spec = importlib.util.spec_from_file_location("vitcam_notebooks_script", ROOT / "scripts" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def executed_notebooks(tmp_path_factory) -> ExecutedNotebooks:
    pytest.importorskip("nbclient")
    folder = tmp_path_factory.mktemp("executed")
    (folder / "notebooks").mkdir()
    runner, errors = notebook_runner(), {}
    for path in NOTEBOOKS:
        try:
            runner.execute(path, out=folder / "notebooks" / path.name)
        except Exception:  # the notebook's own test reports it; the others still run
            errors[path.name] = traceback.format_exc(limit=3)[-4000:]
    return ExecutedNotebooks(folder, errors)
