"""Write the trace-schema table of ``docs/reference.md`` from ``vitcam_nb/core/schema.py``, between
``<!-- schema:start -->`` and ``<!-- schema:end -->``; nothing outside the markers is touched.

Usage::

    python scripts/schema_table.py                 # rewrite docs/reference.md
    python scripts/schema_table.py --check         # exit 1 if it is not up to date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitcam_nb.core.schema import markdown_table

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- schema:start -->", "<!-- schema:end -->"


def with_table(text: str) -> str:
    """``text`` with the schema table between the markers.

    Example:
        >>> with_table("a\\n<!-- schema:start -->\\nold\\n<!-- schema:end -->").count("| `act` |")
        1
    """
    start, end = text.index(START), text.index(END)
    return text[: start + len(START)] + "\n" + markdown_table() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or ``--check``) the table in ``--docs`` (default docs/reference.md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "reference.md")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = args.docs.read_text()
    new = with_table(text)
    if args.check:
        return 0 if new == text else 1
    args.docs.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
