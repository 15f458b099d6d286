"""MkDocs hooks of the documentation site (``mkdocs.yml``): the generated lists are rewritten from the registries
(``scripts/generate.py``) before the build reads the pages; the tutorial notebooks, which live in ``notebooks/``
outside ``docs/``, become pages; and when ``vitcam_nb.export_html`` exists a page embeds an Explorer exported
from a trace of the bundled shapes-vit model. Without it the page is left out, with no placeholder.

By default the pages show the outputs and figures stored with the notebooks (``python scripts/notebooks.py``
stores them; a stored notebook that lacks some is a warning naming it, an error under ``--strict``), so that
``pip install -e ".[docs]" && mkdocs build`` needs none of the packages the tutorials import.
``VITCAM_DOCS_EXECUTE=true`` executes them here instead, not by mkdocs-jupyter (this needs the ``[notebook]``
extra too; ``VITCAM_DOCS_EXECUTED=<folder>`` takes the ones already executed into that folder's ``notebooks/``):
``scripts/notebooks.py`` runs each one without storing widget state and keeps each widget's static picture in
place of its live view, so a page needs no widget manager from the network and shows every figure. A notebook that
fails stops the build with an error naming the notebook and the cell (and the extra, for a missing package).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPLORER_PAGE = "explorer.md"
EXPLORER_FILE = "assets/explorer.html"
# The Explorer frame's height until its page reports its own: the exported page's in a 1280-pixel-wide window
# (1527 px in Chromium: the controls wrap under the image, the methods paragraph is open).
FRAME_HEIGHT = 1530
_TMP = tempfile.TemporaryDirectory(prefix="vitcam-docs-")
# nbconvert's page template imports mermaid.js from a CDN for diagrams; the notebooks have none, and the site
# must not fetch anything.
_MODULE = re.compile(r'<script type="module">.*?</script>', flags=re.S)
log = logging.getLogger("mkdocs.hooks.vitcam_nb")


def _title(path: Path) -> str:
    book = json.loads(path.read_text())
    for cell in book["cells"]:
        if cell["cell_type"] == "markdown":
            return "".join(cell["source"]).splitlines()[0].lstrip("# ").strip()
    return path.stem


def _execute() -> bool:
    return os.environ.get("VITCAM_DOCS_EXECUTE", "false").lower() not in ("0", "false", "no", "")


def _executed_folder() -> Path | None:
    """``VITCAM_DOCS_EXECUTED``: a folder whose ``notebooks/`` holds notebooks this checkout's ``scripts/notebooks.py``
    already executed (the test session runs them once for its notebook tests and this build); those are used as
    they are, and any other is executed here."""
    folder = os.environ.get("VITCAM_DOCS_EXECUTED")
    return Path(folder) if folder else None


def _notebook_runner() -> Any:
    """``scripts/notebooks.py`` (a script of this checkout, not part of the package)."""
    spec = importlib.util.spec_from_file_location("vitcam_docs_notebooks", ROOT / "scripts" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export_html() -> Any:
    """``vitcam_nb.export_html`` if this checkout has it, else None."""
    import vitcam_nb

    return getattr(vitcam_nb, "export_html", None)


def on_pre_build(config: Any) -> None:
    """Regenerate every list of registered things (``scripts/generate.py``: the paper-card schema's enums, the
    docs tables, the README's family list) before the pages are read, so the site shows the registries as they
    are; a changed file is logged (commit it: a test compares the committed copies with the registries)."""
    spec = importlib.util.spec_from_file_location("vitcam_docs_generate", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for rel in module.write():
        log.info("generated lists: rewrote %s from the registries", rel)


def on_config(config: Any) -> Any:
    """Fill the Tutorials section from ``notebooks/`` and add the Explorer page when it can be made."""
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Tutorials" in entry:
            entry["Tutorials"] = [{_title(p): f"notebooks/{p.name}"} for p in NOTEBOOKS]
    if _export_html() is not None:
        config["nav"].append({"Explorer": EXPLORER_PAGE})
    return config


@event_priority(100)  # before mkdocs-jupyter, which converts the notebooks it finds among the files
def on_files(files: Files, config: Any) -> Files:
    """Add the notebooks (and, with ``export_html``, the exported Explorer and its page) to the site's files."""
    src = ROOT
    if _execute():
        src = Path(_TMP.name) / "executed"
        (src / "notebooks").mkdir(parents=True, exist_ok=True)
        runner, done = _notebook_runner(), _executed_folder()
        for path in NOTEBOOKS:
            if done is not None and (done / "notebooks" / path.name).is_file():
                shutil.copyfile(done / "notebooks" / path.name, src / "notebooks" / path.name)
                continue
            try:
                runner.execute(path, out=src / "notebooks" / path.name)
            except runner.NotebookError as err:  # names the notebook, the cell and a missing extra
                raise PluginError(f"{err} (VITCAM_DOCS_EXECUTE=false builds from the stored outputs)") from err
    else:
        runner = _notebook_runner()
        for path in NOTEBOOKS:
            for problem in runner.problems(path):
                log.warning("%s: the page shows the stored outputs; run python scripts/notebooks.py", problem)
    for path in NOTEBOOKS:
        files.append(File(f"notebooks/{path.name}", src_dir=str(src), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    export_html = _export_html()
    if export_html is not None:
        html = _exported_explorer(export_html, Path(_TMP.name) / "explorer.html")
        files.append(File.generated(config, EXPLORER_FILE, abs_src_path=str(html)))
        files.append(File.generated(config, EXPLORER_PAGE, content=_explorer_page(html)))
    return files


def _exported_explorer(export_html: Any, path: Path) -> Path:
    """An Explorer of the bundled shapes-vit model on sample image 0, written with the default axes."""
    import warnings

    import vitcam_nb as vc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        model = vc.load_model("shapes-vit")
        image, *_ = vc.sample_image("shapes", 0, with_mask=True)
        tr = vc.trace(model, image, targets="top3")
        export_html(tr, path, axes=None, quantize="uint8")
    return path


def _explorer_page(html: Path) -> str:
    size = html.stat().st_size / 2**20
    return f"""# Explorer without a kernel

The Explorer below is one self-contained HTML file written by `vc.export_html` from a trace of the bundled
`shapes-vit` model on sample image 0 (default axes, maps quantised to uint8; {size:.1f} MiB). Every control works
in the page: no Python, no kernel, no network. [Open it on its own page]({EXPLORER_FILE}).

```python
import vitcam_nb as vc

model = vc.load_model("shapes-vit")
image, *_ = vc.sample_image("shapes", 0, with_mask=True)
tr = vc.trace(model, image, targets="top3")
vc.export_html(tr, "explorer.html", axes=None, quantize="uint8")
```

<iframe id="vc-explorer-frame" src="{EXPLORER_FILE}" title="vitcam_nb Explorer exported to HTML"
        style="width:100%;height:{FRAME_HEIGHT}px;border:0"></iframe>
<script>
// The exported page reports its height (vitcam_nb/widgets/static/standalone.js): the frame shows all of it.
window.addEventListener("message", (event) => {{
  const frame = document.getElementById("vc-explorer-frame");
  const data = event.data;
  if (frame && event.source === frame.contentWindow && data && data.vitcam === "explorer-height"
      && Number.isFinite(data.height) && data.height > 0) {{
    frame.style.height = `${{Math.min(Math.ceil(data.height), 20000)}}px`;
  }}
}});
</script>
"""


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Drop the CDN module script nbconvert puts on notebook pages (the site stays offline)."""
    return _MODULE.sub(lambda m: "" if "https://cdn" in m.group(0) else m.group(0), output)
