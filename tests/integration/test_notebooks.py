"""Execute every tutorial notebook headless, top to bottom, as CI does; any error fails. The stored notebooks
carry their outputs (``python scripts/notebooks.py``) so they read without a kernel, with no path of the machine
that ran them and no live widget view without its static picture."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _runner():
    spec = importlib.util.spec_from_file_location("vitcam_notebooks", ROOT / "scripts" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebooks_exist_and_are_stored_with_clean_outputs():
    assert len(NOTEBOOKS) >= 12
    runner = _runner()
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        assert book.metadata["kernelspec"]["name"] == "python3", path.name
        assert book.cells[1].metadata.get("tags") == ["parameters"], f"{path.name}: no parameter cell first"
        assert runner.problems(path) == [], "run: python scripts/notebooks.py"
        for cell in book.cells:
            for out in cell.get("outputs", []):
                assert out.get("name") != "stderr" or "Warning" not in out["text"], \
                    f"{path.name}: a warning shown as a red box; explain it in text instead"


def test_the_cleaning_drops_machine_paths_and_live_views():
    runner = _runner()
    book = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{ROOT}/vitcam_nb/api.py:3 /tmp/abc/t.nc"),
                    nbformat.v4.new_output("display_data", data={runner.WIDGET_VIEW: {"model_id": "1"},
                                                                  "image/png": "iVBOR", "text/plain": "w"}),
                    nbformat.v4.new_output("display_data", data={runner.WIDGET_VIEW: {"model_id": "2"},
                                                                  "text/plain": "progress: 0%| 0/24"})]
    book.cells = [cell]
    book.metadata["widgets"] = {"state": {}}
    runner.clean(book)
    assert cell.outputs[0]["text"] == "vitcam_nb/api.py:3 <tmp>/t.nc"
    assert set(cell.outputs[1]["data"]) == {"image/png", "text/plain"} and "widgets" not in book.metadata
    assert len(cell.outputs) == 2  # the progress bar, with no picture, is dropped


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, executed_notebooks):
    # Executed once per session, headless, by scripts/notebooks.py (the run the docs site is built from).
    assert path.name not in executed_notebooks.errors, executed_notebooks.errors.get(path.name)
    book = nbformat.read(executed_notebooks.folder / "notebooks" / path.name, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code" and c.source.strip()]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: a code cell did not run"
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"], path.name
