"""Execute the tutorial notebooks and store them with their outputs, so that they read on a code-hosting page
and in the documentation site without a kernel.

Figures are stored inline as PNG (matplotlib's inline backend, whatever ``MPLBACKEND`` the caller has), at
``FIGURE_DPI`` and reduced to a dithered 256-colour palette (:func:`compact_png`: about a third of the bytes, the
colour of every 8x8 block within a few levels), so that the repository stays small; a live kernel draws them in
full colour.

Outputs are cleaned so that they say nothing about the machine that ran them: paths of this checkout, the home
folder and temporary folders become short placeholders, and a widget's live view is dropped from its display
bundle where the bundle carries the widget's static picture (a page without a widget manager shows the picture;
Jupyter redraws the live widget when the cell runs again). No widget state is stored, so no page needs the widget
manager's script from the network.

Usage::

    python scripts/notebooks.py                # execute every notebook in notebooks/ and store its outputs
    python scripts/notebooks.py 01 05          # only the notebooks whose names start with these
    python scripts/notebooks.py --check        # exit 1 if a stored notebook lacks outputs or figures, or names a path
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# The kernel draws with the inline backend: an inherited MPLBACKEND=Agg (a headless shell, a test run) would
# draw every figure into nothing and store none.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
# 72 dpi (matplotlib's default is 100) keeps a gallery of 36 maps readable with about half the pixels; the stored
# notebooks are part of the repository and of every clone.
FIGURE_DPI = 72
# A code cell that draws a figure: the kit's plots, pyplot, the atlas and ambiguity plots.
DRAWS = re.compile(r"\bvc\.plot\.\w+\(|\bplt\.(?:subplots|figure|imshow|show)\(|\bplot_atlas\(|\.plot\(")
# A notebook that cannot run its example here (weights not on disk) says so in a stream output starting with this;
# the figures of the cells it skipped are then not expected.
SKIPPED = "Skipping"
_TMP = re.escape(tempfile.gettempdir().rstrip("/"))
# Longest first: the checkout may sit inside the home folder, a temporary folder inside either.
_PATHS = [
    (re.compile(re.escape(str(ROOT)) + r"/?"), ""),
    (re.compile(_TMP + r"/[^\s'\"/]+"), "<tmp>"),
    (re.compile(r"(?:/[\w.+-]+)*/(?:site|dist)-packages/"), "<python>/"),
    (re.compile(re.escape(str(Path.home()))), "~"),
]
# What a stored output must not name, wherever it was run: absolute paths of checkouts, homes, temporary folders
# and Python installations.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|root|home|Users|var/folders)/|[\\/](?:site|dist)-packages[\\/]")


def scrub(text: str) -> str:
    """Replace this machine's paths in ``text`` with placeholders.

    Example:
        >>> scrub(str(ROOT / "vitcam_nb" / "api.py") + ":3: DegenerateMapWarning")
        'vitcam_nb/api.py:3: DegenerateMapWarning'
    """
    for pattern, repl in _PATHS:
        text = pattern.sub(repl, text)
    return text


def compact_png(data: str) -> str:
    """A base64 PNG reduced to a 256-colour palette with Floyd-Steinberg dithering (an overlay blends a photo and
    a colour map into tens of thousands of colours; dithering keeps colour bars smooth and the mean colour of a
    small block within a few levels), or ``data`` unchanged when that is not smaller, it already has a palette or
    it is not a whole PNG.

    Example:
        >>> import numpy as np
        >>> from PIL import Image
        >>> buf = io.BytesIO()
        >>> Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(buf, "PNG")
        >>> small = compact_png(base64.b64encode(buf.getvalue()).decode())
        >>> Image.open(io.BytesIO(base64.b64decode(small))).mode, len(small) < len(buf.getvalue()) * 4 / 3
        ('P', True)
    """
    from PIL import Image

    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (ValueError, OSError):  # not a whole PNG (binascii.Error is a ValueError): stored as it came
        return data
    if image.mode == "P":
        return data
    opaque = image.mode != "RGBA" or image.getchannel("A").getextrema()[0] == 255
    image = image.convert("RGB" if opaque else "RGBA")
    # Pillow dithers only onto a given palette: the octree palette first, then Floyd-Steinberg onto it.
    palette = image.quantize(256, method=Image.Quantize.FASTOCTREE)
    if opaque:
        palette = image.quantize(palette=palette, dither=Image.Dither.FLOYDSTEINBERG)
    out = io.BytesIO()
    palette.save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode() if out.tell() < len(raw) else data


def clean(book) -> None:
    """Scrub paths from every output, keep a widget's static picture in place of its live view, drop live views
    that have no picture (progress bars), and store every PNG with a palette (:func:`compact_png`)."""
    book.metadata.pop("widgets", None)
    for cell in book.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        # A live view with no static picture (a progress bar) cannot be shown without a kernel, and its text is
        # the state it was created in ("0/24"), not what happened: it is dropped.
        cell.outputs = [out for out in cell.get("outputs", [])
                        if not (WIDGET_VIEW in out.get("data", {}) and "image/png" not in out.get("data", {}))]
        for out in cell.outputs:
            if out.get("output_type") == "stream":
                out["text"] = scrub(out["text"])
            elif out.get("output_type") == "error":
                out["traceback"] = [scrub(line) for line in out["traceback"]]
            data = out.get("data")
            if data is None:
                continue
            if WIDGET_VIEW in data and "image/png" in data:
                del data[WIDGET_VIEW]
            if isinstance(data.get("image/png"), str):
                data["image/png"] = compact_png(data["image/png"])
            for mime, value in list(data.items()):
                if mime.startswith("text/") and isinstance(value, str):
                    data[mime] = scrub(value)


# The modules the tutorials import beyond the base install (open_clip_torch, transformers): the [notebook] extra.
TUTORIAL_PACKAGES = ("open_clip", "transformers")


class NotebookError(RuntimeError):
    """A notebook that failed to run; the message names the notebook, the cell and the error (and, for a missing
    package, the extra that installs it)."""


def failure_message(path: Path, book, err: Exception) -> str:
    """What :class:`NotebookError` says about ``err`` raised while running ``book`` (read from ``path``).

    Example:
        >>> import nbformat
        >>> book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import open_clip")])
        >>> book.cells[0].outputs = [nbformat.v4.new_output("error", ename="ModuleNotFoundError",
        ...                                                  evalue="No module named 'open_clip'", traceback=[])]
        >>> msg = failure_message(Path("08_clip_prompts.ipynb"), book, RuntimeError("cell failed"))
        >>> msg.split(" (")[0]
        "notebook 08_clip_prompts.ipynb failed in cell 0: ModuleNotFoundError: No module named 'open_clip'"
        >>> msg.endswith('(the tutorials need the [notebook] extra: pip install -e ".[notebook]")')
        True
    """
    cell = next((i for i, c in enumerate(book.cells) if c.cell_type == "code"
                 and any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
    ename, evalue = getattr(err, "ename", type(err).__name__), getattr(err, "evalue", str(err))
    if cell is not None:
        error = next(o for o in book.cells[cell].outputs if o.get("output_type") == "error")
        ename, evalue = error["ename"], error["evalue"]
    where = f" in cell {cell}" if cell is not None else ""
    message = f"notebook {path.name} failed{where}: {ename}: {scrub(str(evalue))}"
    missing = re.match(r"No module named '([\w.]+)'", str(evalue))
    if ename == "ModuleNotFoundError" and missing and missing.group(1).split(".")[0] in TUTORIAL_PACKAGES:
        message += ' (the tutorials need the [notebook] extra: pip install -e ".[notebook]")'
    return message


def execute(path: Path, out: Path | None = None, timeout: int = 600):
    """Run ``path`` top to bottom in a fresh kernel (in a temporary folder), clean it, write it to ``out``; a
    failure raises :class:`NotebookError` naming the notebook and the cell.

    Example:
        >>> execute(NOTEBOOKS / "01_quickstart.ipynb", out=Path("/tmp/01.ipynb"))  # doctest: +SKIP
    """
    import nbclient
    import nbformat

    book = nbformat.read(path, as_version=4)
    env = {"MPLBACKEND": INLINE_BACKEND, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix="vitcam-nb-") as cwd:
            client = nbclient.NotebookClient(
                book, timeout=timeout, kernel_name="python3", store_widget_state=False,
                resources={"metadata": {"path": cwd}},
                # key=value: traitlets 5 warns about a dict literal, and the warning would be stored as output.
                extra_arguments=[f"--InlineBackend.rc=figure.dpi={FIGURE_DPI}"])
            try:
                client.execute()
            except Exception as err:  # nbclient's CellExecutionError, a dead kernel, a timeout
                raise NotebookError(failure_message(path, book, err)) from err
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    clean(book)
    if out is not None:
        nbformat.write(book, out)
    return book


def missing_figures(book, name: str) -> list[str]:
    """The code cells of ``book`` that draw a figure (:data:`DRAWS`) but store no PNG, unless the notebook says
    it skipped its example (a stream output starting with :data:`SKIPPED`).

    Example:
        >>> import nbformat
        >>> book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("vc.plot.grid(tr, g);")])
        >>> missing_figures(book, "x.ipynb")
        ['x.ipynb cell 0: draws a figure but stores no image (run scripts/notebooks.py)']
    """
    outputs = [out for cell in book.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    if any(out.get("output_type") == "stream" and str(out.get("text", "")).startswith(SKIPPED) for out in outputs):
        return []
    return [f"{name} cell {i}: draws a figure but stores no image (run scripts/notebooks.py)"
            for i, cell in enumerate(book.cells)
            if cell.cell_type == "code" and DRAWS.search(cell.source)
            and not any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))]


def problems(path: Path) -> list[str]:
    """What keeps a stored notebook from reading without a kernel: code cells never run, figures not stored,
    machine paths.

    Example:
        >>> problems(NOTEBOOKS / "01_quickstart.ipynb")
        []
    """
    import nbformat

    book = nbformat.read(path, as_version=4)
    found = []
    for i, cell in enumerate(book.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if cell.execution_count is None:
            found.append(f"{path.name} cell {i}: not executed")
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append(f"{path.name} cell {i}: stored with an error")
            if out.get("name") == "stderr" and "Warning" in str(out.get("text", "")):
                found.append(f"{path.name} cell {i}: a warning stored as a red box (explain it in text instead)")
            if WIDGET_VIEW in out.get("data", {}):
                found.append(f"{path.name} cell {i}: a live widget view without a static picture")
            text = str(out.get("text", "")) + str(out.get("data", {}).get("text/plain", ""))
            if MACHINE_PATH.search(text):
                found.append(f"{path.name} cell {i}: names a path of the machine that ran it")
    if "widgets" in book.metadata:
        found.append(f"{path.name}: stores widget state")
    return found + missing_figures(book, path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="run only notebooks whose names start with these")
    parser.add_argument("--check", action="store_true", help="check the stored notebooks instead of running them")
    args = parser.parse_args(argv)
    paths = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if not args.prefixes
             or any(p.name.startswith(x) for x in args.prefixes)]
    if args.check:
        found = [line for p in paths for line in problems(p)]
        print("\n".join(found) or f"{len(paths)} notebooks stored with their outputs")
        return 1 if found else 0
    failed = []
    for path in paths:
        print(f"running {path.name}", flush=True)
        try:
            execute(path, out=path)
        except NotebookError as err:  # the others still run; the stored notebook is left as it was
            print(err, file=sys.stderr, flush=True)
            failed.append(path.name)
    if failed:
        print(f"{len(failed)} notebooks failed and were not stored: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
