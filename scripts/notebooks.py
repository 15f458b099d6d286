"""Execute the tutorial notebooks and store them with their outputs, so that they read on a code-hosting page
and in the documentation site without a kernel.

Outputs are cleaned so that they say nothing about the machine that ran them: paths of this checkout, the
home folder and temporary folders become short placeholders, and a widget's live view is dropped from its
display bundle where the bundle carries the widget's static picture (a page without a widget manager shows
the picture; Jupyter redraws the live widget when the cell runs again). No widget state is stored, so no page
needs the widget manager's script from the network.

Usage::

    python scripts/notebooks.py                # execute every notebook in notebooks/ and store its outputs
    python scripts/notebooks.py 01 05          # only the notebooks whose names start with these
    python scripts/notebooks.py --check        # exit 1 if a stored notebook lacks outputs or names a path
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
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


def clean(book) -> None:
    """Scrub paths from every output, keep a widget's static picture in place of its live view, and drop live
    views that have no picture (progress bars)."""
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
            for mime, value in list(data.items()):
                if mime.startswith("text/") and isinstance(value, str):
                    data[mime] = scrub(value)


def execute(path: Path, out: Path | None = None, timeout: int = 600):
    """Run ``path`` top to bottom in a fresh kernel (in a temporary folder), clean it, write it to ``out``.

    Example:
        >>> execute(NOTEBOOKS / "01_quickstart.ipynb", out=Path("/tmp/01.ipynb"))  # doctest: +SKIP
    """
    import nbclient
    import nbformat

    book = nbformat.read(path, as_version=4)
    env = {"MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix="vitcam-nb-") as cwd:
            client = nbclient.NotebookClient(book, timeout=timeout, kernel_name="python3", store_widget_state=False,
                                             resources={"metadata": {"path": cwd}})
            client.execute()
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


def problems(path: Path) -> list[str]:
    """What keeps a stored notebook from reading without a kernel: code cells never run, machine paths.

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
            if WIDGET_VIEW in out.get("data", {}):
                found.append(f"{path.name} cell {i}: a live widget view without a static picture")
            text = str(out.get("text", "")) + str(out.get("data", {}).get("text/plain", ""))
            if MACHINE_PATH.search(text):
                found.append(f"{path.name} cell {i}: names a path of the machine that ran it")
    if "widgets" in book.metadata:
        found.append(f"{path.name}: stores widget state")
    return found


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
    for path in paths:
        print(f"running {path.name}", flush=True)
        execute(path, out=path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
