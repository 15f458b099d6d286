"""Measure the support matrix (tested configuration x site F1..F6) by running the families' reference tests.

Usage::

    python scripts/support_matrix.py [--json docs/support_matrix.json]

Runs ``test_site_reference`` and ``test_site_not_applicable`` of the family test files that exist (``ids``
are ``"<family>-<site>"``, one family per matrix row), reads pytest's JUnit XML and renders one cell per
(family, site): ✓ the trace matches the autograd reference, n/a the family has no such site and asking for it
is refused, ✗ a test failed, blank not tested (no test, or skipped). The cells are written to
``docs/support_matrix.json`` (the measured data), then ``scripts/generate.py`` renders the table into
``docs/models.md`` with the registered families beside it (the docs build runs it too).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ("tests/unit/model/test_adapters.py", "tests/unit/model/test_swin.py",
              "tests/unit/model/test_open_clip.py", "tests/unit/model/test_blip.py", "tests/unit/model/test_hf.py",
              "tests/unit/model/test_hf_swin.py", "tests/unit/model/test_hf_upernet.py",
              "tests/unit/model/test_hf_dpt.py", "tests/unit/model/test_video.py",
              "tests/unit/model/test_yolos.py", "tests/unit/model/test_owl.py")
SITES = ("F1", "F2", "F3", "F4", "F5", "F6")
KINDS = {"test_site_reference": "✓", "test_site_not_applicable": "n/a"}
JSON = ROOT / "docs" / "support_matrix.json"
_CASE = re.compile(r"^(test_site_reference|test_site_not_applicable)\[(.+)-(F[1-6])\]$")


def run_tests(files: list[str], junit: Path) -> int:
    """Run the matrix tests of ``files`` with pytest, writing JUnit XML to ``junit``; returns pytest's exit code.

    Example:
        >>> run_tests(["tests/unit/model/test_adapters.py"], Path("/tmp/matrix.xml"))  # doctest: +SKIP
        0
    """
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
           "test_site_reference or test_site_not_applicable", f"--junitxml={junit}", *files]
    return subprocess.run(cmd, cwd=ROOT, check=False).returncode


def parse_junit(text: str) -> dict[str, dict[str, str]]:
    """Cells ``{family: {site: mark}}`` from JUnit XML, families in the order their tests ran.

    Example:
        >>> xml = ('<testsuites><testsuite><testcase name="test_site_reference[beit-F2]"/>'
        ...        '<testcase name="test_site_not_applicable[eva_postnorm-F1]"/>'
        ...        '<testcase name="test_site_reference[eva_postnorm-F3]"><failure/></testcase>'
        ...        '</testsuite></testsuites>')
        >>> parse_junit(xml)
        {'beit': {'F2': '✓'}, 'eva_postnorm': {'F1': 'n/a', 'F3': '✗'}}
    """
    matrix: dict[str, dict[str, str]] = {}
    for case in ET.fromstring(text).iter("testcase"):
        m = _CASE.match(case.get("name", ""))
        if not m:
            continue
        test, family, site = m.groups()
        if case.find("skipped") is not None:
            mark = ""
        elif case.find("failure") is not None or case.find("error") is not None:
            mark = "✗"
        else:
            mark = KINDS[test]
        row = matrix.setdefault(family, {})
        # a failure anywhere in a cell wins; otherwise the first verdict stays
        if mark == "✗" or not row.get(site):
            row[site] = mark
    return matrix


def to_markdown(matrix: dict[str, dict[str, str]]) -> str:
    """Render the matrix as a markdown table with a legend.

    Example:
        >>> print(to_markdown({"beit": {"F1": "✓", "F2": "✓"}}).splitlines()[2])
        | `beit` | ✓ | ✓ |  |  |  |  |
    """
    lines = ["| family | " + " | ".join(SITES) + " |", "|---|" + "---|" * len(SITES)]
    for family, row in matrix.items():
        lines.append(f"| `{family}` | " + " | ".join(row.get(s, "") for s in SITES) + " |")
    lines += ["", "✓ stored activations and gradients match a hand-written autograd reference (relative error "
              "≤ 1e-5) · n/a the family has no such site and tracing it is refused · ✗ failing · blank: not tested."]
    return "\n".join(lines)


def write_json(path: Path, matrix: dict[str, dict[str, str]]) -> None:
    """Write the measured cells to ``path`` (the file ``scripts/generate.py`` renders the table from).

    Example:
        >>> write_json(Path("/tmp/m.json"), {"beit": {"F1": "✓"}}); json.loads(Path("/tmp/m.json").read_text())["rows"]
        {'beit': {'F1': '✓'}}
    """
    about = json.loads(JSON.read_text(encoding="utf-8"))["about"] if JSON.exists() else ""
    path.write_text(json.dumps({"about": about, "rows": matrix}, indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: run the tests, print the table, write the cells and regenerate the docs.

    Example:
        >>> main(["--json", "docs/support_matrix.json"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=JSON, help="where to write the measured cells")
    args = parser.parse_args(argv)
    files = [f for f in TEST_FILES if (ROOT / f).exists()]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "matrix.xml"
        code = run_tests(files, junit)
        if not junit.exists():
            print(f"pytest wrote no JUnit XML (exit code {code})", file=sys.stderr)
            return 1
        matrix = parse_junit(junit.read_text())
    table = to_markdown(matrix)
    print(table)
    write_json(args.json, matrix)
    if args.json.resolve() == JSON.resolve():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py")], cwd=ROOT, check=True)
    # failing cells are part of the table, not an error of this script
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main())
