"""Execute every tutorial notebook headless, top to bottom, as CI does; any error fails, naming the notebook. The
stored notebooks carry their outputs and figures (``python scripts/notebooks.py``) so they read without a kernel,
with no path of the machine that ran them and no live widget view without its static picture; the handout command
of notebooks/README.md gives one HTML file with the figures and no script from the network."""

from __future__ import annotations

import importlib.util
import re
import sys
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


def test_a_notebook_that_fails_is_named_with_its_cell_and_the_extra_it_needs(tmp_path):
    runner = _runner()
    book = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# CLIP"), nbformat.v4.new_code_cell("x = 1"),
        # What the kernel reports for an import of a package that is not installed.
        nbformat.v4.new_code_cell("raise ModuleNotFoundError(\"No module named 'open_clip'\", name='open_clip')")])
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "08_clip.ipynb"
    nbformat.write(book, path)
    with pytest.raises(runner.NotebookError) as info:
        runner.execute(path, out=tmp_path / "out.ipynb", timeout=120)
    assert str(info.value) == ("notebook 08_clip.ipynb failed in cell 2: ModuleNotFoundError: No module named "
                               "'open_clip' (the tutorials need the [notebook] extra: pip install -e \".[notebook]\")")
    assert not (tmp_path / "out.ipynb").exists()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, executed_notebooks):
    # Executed once per session, headless, by scripts/notebooks.py (the run the docs site is built from).
    assert path.name not in executed_notebooks.errors, executed_notebooks.errors.get(path.name)
    book = nbformat.read(executed_notebooks.folder / "notebooks" / path.name, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code" and c.source.strip()]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: a code cell did not run"
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"], path.name


# --------------------------------------------------------------------------------------------------
# figures: stored with the notebooks (read from the .ipynb JSON, nothing executed)

def _pngs(cell) -> list[str]:
    return [out["data"]["image/png"] for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_cell_that_draws_a_figure_stores_it(path):
    import base64
    import io

    from PIL import Image

    book = nbformat.read(path, as_version=4)
    skipped = any(str(o.get("text", "")).startswith("Skipping") for c in book.cells for o in c.get("outputs", []))
    drawing = [i for i, c in enumerate(book.cells) if c.cell_type == "code" and re.search(
        r"vc\.plot\.\w+\(|plt\.(?:subplots|figure|imshow|show)\(|plot_atlas\(|\.plot\(", c.source)]
    missing = [i for i in drawing if not _pngs(book.cells[i])]
    assert skipped or not missing, f"{path.name}: cells {missing} draw a figure but store none (scripts/notebooks.py)"
    assert _runner().missing_figures(book, path.name) == []  # what python scripts/notebooks.py --check says
    for cell in book.cells:
        for data in _pngs(cell):
            image = Image.open(io.BytesIO(base64.b64decode(data)))
            image.load()  # a whole, decodable PNG
            assert image.format == "PNG" and min(image.size) >= 64, (path.name, image.size)


def test_the_figure_check_flags_a_drawing_cell_without_an_image():
    runner = _runner()
    book = nbformat.v4.new_notebook()
    draws = nbformat.v4.new_code_cell("g = vc.gallery(tr, r)\nvc.plot.grid(tr, g);")
    quiet = nbformat.v4.new_code_cell("print(tr.target_label.values)")
    book.cells = [quiet, draws]
    assert runner.missing_figures(book, "x.ipynb") == [
        "x.ipynb cell 1: draws a figure but stores no image (run scripts/notebooks.py)"]
    draws.outputs = [nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure>"})]
    assert runner.missing_figures(book, "x.ipynb") == []
    # A notebook that says it skipped its example (no weights on disk) draws nothing and is not flagged.
    draws.outputs = []
    quiet.outputs = [nbformat.v4.new_output("stream", name="stdout", text="Skipping: weights are not on disk")]
    assert runner.missing_figures(book, "x.ipynb") == []


def test_stored_figures_keep_the_repository_small():
    # Figures are stored at 72 dpi with a dithered 256-colour palette (scripts/notebooks.py compact_png).
    sizes = {p.name: p.stat().st_size for p in NOTEBOOKS}
    assert sum(sizes.values()) < 4 * 2**20, sizes  # 2.6 MiB when first stored with figures (1.1 MiB without)
    assert max(sizes.values()) < 2**20, sizes


def test_compact_png_keeps_the_picture_within_a_palette_step():
    import base64
    import io

    import numpy as np
    from PIL import Image

    runner = _runner()
    # A colour-bar-like ramp blended over noise: tens of thousands of colours, as in an overlay.
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 256)[None, :, None] * np.array([1.0, 0.5, 0.2])
    rgb = np.clip(0.6 * ramp + 0.4 * rng.integers(0, 255, (96, 256, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    small = base64.b64decode(runner.compact_png(base64.b64encode(buf.getvalue()).decode()))
    back = np.asarray(Image.open(io.BytesIO(small)).convert("RGB"), dtype=float)
    assert len(small) < buf.tell()
    # Dithering spreads the error: the local mean colour (8x8 blocks) stays within a few levels of the original.
    blocks = (back - rgb).reshape(12, 8, 32, 8, 3).mean(axis=(1, 3))
    assert np.abs(blocks).max() < 6.0


# --------------------------------------------------------------------------------------------------
# notebook 02: each question can be answered from the gallery of its own section


def test_taxonomy_questions_name_only_values_their_section_shows():
    from vitcam_nb.core import recipe as rc

    values = {*rc.HEAD_RULES, *rc.TARGETS, *rc.WEIGHT_TOKENS, *rc.RESHAPES, *rc.UPSAMPLES, *rc.LAYER_FUSIONS}
    book = nbformat.read(ROOT / "notebooks" / "02_taxonomy_tour.ipynb", as_version=4)
    section, checked = [], []
    for cell in book.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            section = []
        elif cell.cell_type == "code":
            section.append(cell.source)
        elif cell.source.startswith("**Question.**"):
            question = cell.source.split("<details>")[0]
            named = {v for v in re.findall(r"`(\w+)`", question) if v in values}
            shown = " ".join(section)
            for value in named:
                assert f'"{value}"' in shown, f"question names {value!r}, its section's galleries do not show it"
            checked += named
    assert {"relu_then_mean", "mean_then_relu"} <= set(checked)


# --------------------------------------------------------------------------------------------------
# the handout of notebooks/README.md: one self-contained HTML file


def test_the_handout_command_gives_one_html_file_with_the_figures_and_no_script_from_the_network():
    import shlex

    from nbconvert.nbconvertapp import NbConvertApp

    readme = (ROOT / "notebooks" / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("jupyter nbconvert --to html"))
    args = shlex.split(line)[2:]
    notebook = next(a for a in args if a.endswith(".ipynb"))
    app = NbConvertApp()
    app.parse_command_line([a for a in args if a != notebook])  # the documented options, as the command reads them
    assert app.export_format == "html"
    from nbconvert import HTMLExporter

    # The app's exporter, in-process and writing nothing; the template folder is relative to the clone's root.
    config = app.config
    base = config.TemplateExporter.get("extra_template_basedirs")
    if base:
        config.TemplateExporter.extra_template_basedirs = [str(ROOT / b) for b in
                                                           ([base] if isinstance(base, str) else base)]
    html, _ = HTMLExporter(config=config).from_filename(str(ROOT / notebook))
    book = nbformat.read(ROOT / notebook, as_version=4)
    stored = sum(len(_pngs(c)) for c in book.cells)
    assert stored >= 8  # notebook 02's galleries, its fused maps and the Explorer's picture
    assert html.count("data:image/png;base64,") >= stored
    scripts = re.findall(r"<script\b[^>]*>", html, flags=re.I)
    assert not [s for s in scripts if re.search(r"\bsrc\s*=", s, flags=re.I)], scripts
    assert not re.search(r"""(?:import\(|@import|url\()\s*["']?https?://""", html), "loads something from the web"
    assert "require.min.js" not in html and "mathjax" not in html.lower()
    assert "vc.plot.grid" not in html  # --no-input: code cells hidden
    # The answers stay collapsed: each one is inside its <details> (an HTML rewrite such as --embed-images closes
    # the <details> right after its summary and leaves the answer open below).
    answers = re.findall(r"<details>(.*?)</details>", html, flags=re.S)
    questions = sum(c.source.count("<details>") for c in book.cells if c.cell_type == "markdown")
    assert len(answers) == questions >= 5
    assert all(re.search(r"</summary>\s*<p>\S", a) for a in answers), answers


# --------------------------------------------------------------------------------------------------
# the lesson plan's install: the [notebook] extra brings every package a tutorial imports


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution the requirements install, through the installed packages' own metadata."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            # A dependency's own extras are not followed (marker evaluated with no extra).
            todo += [Requirement(r) for r in (md.requires(req.name) or [])]
        except md.PackageNotFoundError:
            continue
    return seen


def test_the_notebook_extra_installs_every_package_the_tutorials_import():
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _closure(project["dependencies"] + project["optional-dependencies"]["notebook"])
    owners = md.packages_distributions()
    missing = {}
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            optional = "except ImportError" in cell.source  # the cell runs without it (and says so)
            for module in re.findall(r"^\s*(?:from|import)\s+(\w+)", cell.source, flags=re.M):
                if module in sys.stdlib_module_names or module == "vitcam_nb" or optional:
                    continue
                dists = {canonicalize_name(d) for d in owners.get(module, [module])}
                if not dists & installed:
                    missing.setdefault(path.name, set()).add(module)
    # A bundled model a tutorial loads may need an extra (shapes-video, shapes-yolos: transformers).
    import vitcam_nb as vc

    extras = {row["name"]: row["extra"] for row in vc.list_models()}
    for path in NOTEBOOKS:
        source = " ".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        for name in set(re.findall(r"[\"'](shapes-[\w-]+)[\"']", source)) & {n for n, e in extras.items() if e}:
            needs = _closure(project["optional-dependencies"][extras[name]])
            if not needs <= installed:
                missing.setdefault(path.name, set()).add(f"{name}: {sorted(needs - installed)}")
    assert not missing, f"needed by the tutorials but not installed by [notebook]: {missing}"
    readme = (ROOT / "notebooks" / "README.md").read_text()
    assert 'pip install -e ".[notebook]"' in readme and 'pip install "vitcam_nb' not in readme
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in readme
