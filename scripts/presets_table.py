"""Write ``docs/presets.md``'s table of published presets from ``vitcam_nb.core.preset_taxonomy.TAXONOMY``, between
``<!-- presets:start -->`` and ``<!-- presets:end -->``; nothing outside the markers is touched.

Usage::

    python scripts/presets_table.py                 # rewrite docs/presets.md
    python scripts/presets_table.py --check         # exit 1 if it is not up to date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitcam_nb.presets import markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "presets.md"
START, END = "<!-- presets:start -->", "<!-- presets:end -->"


def with_table(text: str) -> str:
    """``text`` with the preset table between the markers.

    Example:
        >>> with_table("a\\n<!-- presets:start -->\\nold\\n<!-- presets:end -->").count("| `vit_cx` |")
        1
    """
    start, end = text.index(START), text.index(END)
    return text[: start + len(START)] + "\n" + markdown_table() + "\n" + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/presets.md is not up to date")
    args = parser.parse_args()
    text = DOC.read_text()
    new = with_table(text)
    if args.check:
        return 0 if new == text else 1
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
