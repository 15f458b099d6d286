"""The tutorial notebooks executed once per test session, shared by the notebook tests (each notebook runs without
error) and the documentation site's build (which would otherwise execute every notebook a second time).

Each notebook is run by ``scripts/notebooks.py`` (a fresh kernel in a temporary folder, headless, the stored
outputs cleaned as the site shows them) and written to the session's folder; one that fails is not written, and
its error is kept for its own test to report. Under pytest-xdist the workers share one execution (a file lock).
"""

from __future__ import annotations

import importlib.util
import json
import os
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


def _execute_all(folder: Path) -> ExecutedNotebooks:
    (folder / "notebooks").mkdir(parents=True, exist_ok=True)
    runner, errors = notebook_runner(), {}
    for path in NOTEBOOKS:
        try:
            runner.execute(path, out=folder / "notebooks" / path.name)
        except Exception:  # the notebook's own test reports it; the others still run
            errors[path.name] = traceback.format_exc(limit=3)[-4000:]
    return ExecutedNotebooks(folder, errors)


@pytest.fixture(scope="session")
def executed_notebooks(tmp_path_factory) -> ExecutedNotebooks:
    pytest.importorskip("nbclient")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _execute_all(tmp_path_factory.mktemp("executed"))
    # Under pytest-xdist each worker has its own session: the first worker to ask executes the notebooks into the
    # run's shared temporary folder (every worker's base folder sits in it), under a lock; the others wait and read
    # them, so the notebooks run once per test run, not once per worker that needs them.
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "executed-notebooks"
    done = shared / "errors.json"
    with FileLock(str(shared) + ".lock"):
        if not done.exists():
            executed = _execute_all(shared)
            done.write_text(json.dumps(executed.errors))
    return ExecutedNotebooks(shared, json.loads(done.read_text()))
