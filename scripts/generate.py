"""Write every list of registered things from the registries: nothing that lists them is kept by hand.

Usage::

    python scripts/generate.py            # rewrite every generated part
    python scripts/generate.py --check    # exit 1, naming the files, if a committed copy is out of date

What it writes (the docs build runs it first, ``docs/_hooks/site.py``; ``tests/integration/test_generated.py``
fails when a committed copy differs from what the registries give):

- the paper-card schema's ``weighting`` enum (``vitcam_nb/data/audit/paper_card.schema.json`` and its served copy
  ``docs/paper_card.schema.json``), from :func:`vitcam_nb.core.weighting.weighting_names`;
- the tables between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->`` in the docs and the
  README: weightings, backward rules, metrics, presets, families, trace kinds, the support matrix;
- the preset taxonomy table of ``docs/presets.md`` and the trace-schema table of ``docs/reference.md`` (their
  older ``<!-- presets:start -->`` / ``<!-- schema:start -->`` markers; ``scripts/presets_table.py`` and
  ``scripts/schema_table.py`` stay as their single-table entry points).

The support matrix claims only what tests established: its cells come from ``docs/support_matrix.json``, which
``python scripts/support_matrix.py`` writes by running the families' reference tests; its list of registered
families comes from :func:`vitcam_nb.adapters.registry.supported_families`, and a registered family with no
measured row is said to have none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the sibling table scripts are imported below
    sys.path.insert(0, str(ROOT))

SCHEMA_COPIES = ("vitcam_nb/data/audit/paper_card.schema.json", "docs/paper_card.schema.json")
SUPPORT_JSON = "docs/support_matrix.json"
SITES = ("F1", "F2", "F3", "F4", "F5", "F6")


def _begin(name: str) -> str:
    return f"<!-- BEGIN generated: {name} (python scripts/generate.py; do not edit) -->"


def _end(name: str) -> str:
    return f"<!-- END generated: {name} -->"


def _cell(text: object) -> str:
    """A table cell: one line, pipes escaped (registered descriptions are free text)."""
    return " ".join(str(text).split()).replace("|", "&#124;")


def _names(items: object) -> str:
    return ", ".join(f"`{n}`" for n in items)


# --- the renderers: one per generated part, each reading a registry -------------------------------------------


def weightings_table() -> str:
    """Every registered weighting with its formula and whether sweeps over weightings include it.

    Example:
        >>> "| `gradcam` |" in weightings_table()
        True
    """
    from vitcam_nb.core.weighting import WEIGHTINGS, channel_weighting_names, weighting_names

    channel = set(channel_weighting_names())
    lines = ["| weighting | formula the checklist states | kind |", "| --- | --- | --- |"]
    for name in weighting_names():
        w = WEIGHTINGS.get(name)
        kind = "channel weighting" if name in channel else ("published method" if w.method else "weighting")
        if w.scores:
            kind += f" (reads `{w.scores}` from `vc.score`)"
        lines.append(f"| `{name}` | {_cell(w.formula)} | {kind} |")
    return "\n".join(lines)


def weightings_list() -> str:
    """The weighting names a card may hold, as one line.

    Example:
        >>> "`hirescam`" in weightings_list()
        True
    """
    from vitcam_nb.core.weighting import weighting_names

    return f"`weighting` takes one of the kit's registered weightings: {_names(weighting_names())}."


def _rule(name: str) -> object:
    from vitcam_nb.core import rules

    table = rules.RULES
    return table.get(name) if hasattr(table, "get") else table[name]


def rules_table() -> str:
    """Every backward rule with what it substitutes and its source.

    Example:
        >>> "| `cp_lrp` |" in rules_table()
        True
    """
    from vitcam_nb.core.rules import rule_names

    lines = ["| rule | what the backward pass substitutes | source |", "| --- | --- | --- |"]
    for name in rule_names():
        info = _rule(name)
        lines.append(f"| `{name}` | {_cell(info.description)} | {_cell(info.citation)} |")
    return "\n".join(lines)


def metrics_table() -> str:
    """Every registered score-card metric with its category, direction and what it needs.

    Example:
        >>> "| `deletion_auc` | faithfulness |" in metrics_table()
        True
    """
    from vitcam_nb.evaluate.metric_registry import METRICS, metric_names

    lines = ["| metric | category | better | needs | run by default | description |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in metric_names():
        m = METRICS.get(name)
        lines.append(f"| `{name}` | {m.category} | {'higher' if m.higher_is_better else 'lower'} | "
                     f"{', '.join(m.needs) or '-'} | {'yes' if m.by_default else 'when named'} | "
                     f"{_cell(m.description) or '-'} |")
    return "\n".join(lines)


def presets_list() -> str:
    """Every named preset, as one line.

    Example:
        >>> "`gradcam`" in presets_list()
        True
    """
    import vitcam_nb as vc

    return f"Presets (`vc.presets.names()`): {_names(vc.presets.names())}."


def families_list() -> str:
    """Every registered model family, as one line.

    Example:
        >>> "`vit`" in families_list()
        True
    """
    from vitcam_nb.adapters.registry import supported_families

    return (f"Registered families (`supported_families()`, every optional package installed): "
            f"{_names(supported_families())}.")


def trace_kinds_list() -> str:
    """Every registered trace kind, in dispatch order.

    Example:
        >>> "`flat`" in trace_kinds_list()
        True
    """
    from vitcam_nb.core.kinds import TRACE_KINDS

    return f"Trace kinds, in the order `vc.cam` asks them (`TRACE_KINDS`): {_names(TRACE_KINDS.names())}."


def support_matrix(measured: dict | None = None) -> str:
    """The support matrix: measured rows from ``docs/support_matrix.json`` (what the reference tests established),
    then the registered families that have no measured row.

    Example:
        >>> print(support_matrix({"rows": {"vit": {"F1": "✓"}}}).splitlines()[2])
        | `vit` | ✓ |  |  |  |  |  |
    """
    from vitcam_nb.adapters.registry import supported_families

    if measured is None:
        measured = json.loads((ROOT / SUPPORT_JSON).read_text(encoding="utf-8"))
    rows = measured["rows"]
    lines = ["| tested configuration | " + " | ".join(SITES) + " |", "|---|" + "---|" * len(SITES)]
    for label, cells in rows.items():
        lines.append(f"| `{label}` | " + " | ".join(cells.get(s, "") for s in SITES) + " |")
    families = supported_families()
    # a row counts for the registered family its label starts with ("eva02" for "eva"): a new family is never
    # covered by an older family's rows, since its name is longer than theirs or differs
    untested = [f for f in families if not any(label.startswith(f) for label in rows)]
    lines += ["", "✓ stored activations and gradients match a hand-written autograd reference (relative error "
              "≤ 1e-5) · n/a the family has no such site and tracing it is refused · ✗ failing · blank: not "
              "tested. Cells from `docs/support_matrix.json`, written by `python scripts/support_matrix.py` (it "
              "runs each family's `test_site_reference` and `test_site_not_applicable`).", "",
              families_list()]
    lines.append("Registered families without a measured row: " + (_names(untested) if untested else "none") + ".")
    return "\n".join(lines)


def _vlm_tables():
    """``scripts/vlm_tables.py``, the generative-VLM tables of docs/vlm.md (a sibling script, loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vitcam_vlm_tables", ROOT / "scripts" / "vlm_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vlm_families_table() -> str:
    return _vlm_tables().vlm_families_table()


def vlm_presets_table() -> str:
    return _vlm_tables().vlm_presets_table()


def vlm_schema_table() -> str:
    return _vlm_tables().vlm_schema_table()


def shapes_vlm_summary() -> str:
    return _vlm_tables().shapes_vlm_summary()


def _presets_taxonomy() -> str:
    from vitcam_nb.presets import markdown_table

    return markdown_table()


def _schema_table() -> str:
    from vitcam_nb.core.schema import markdown_table

    return markdown_table()


# (file, name, renderer): one generated part each. ``name`` is the marker's name; the two older markers are kept.
PARTS: tuple[tuple[str, str, Callable[[], str]], ...] = (
    ("docs/paper_cards.md", "weightings", weightings_list),
    ("docs/extending.md", "weightings", weightings_table),
    ("docs/extending.md", "rules", rules_table),
    ("docs/api.md", "rules", rules_table),
    ("docs/extending.md", "metrics", metrics_table),
    ("docs/extending.md", "trace-kinds", trace_kinds_list),
    ("docs/evaluation.md", "metrics", metrics_table),
    ("docs/presets.md", "presets", presets_list),
    ("docs/presets.md", "presets:start", _presets_taxonomy),
    ("docs/reference.md", "schema:start", _schema_table),
    ("docs/models.md", "support-matrix", support_matrix),
    ("README.md", "families", families_list),
    ("docs/vlm.md", "vlm-families", vlm_families_table),
    ("docs/vlm.md", "vlm-presets", vlm_presets_table),
    ("docs/reference.md", "vlm-schema", vlm_schema_table),
    ("docs/vlm.md", "shapes-vlm", shapes_vlm_summary),
)


def _markers(name: str) -> tuple[str, str]:
    if name.endswith(":start"):  # an older marker pair: <!-- presets:start --> ... <!-- presets:end -->
        stem = name[: -len(":start")]
        return f"<!-- {stem}:start -->", f"<!-- {stem}:end -->"
    return _begin(name), _end(name)


def replace_between(text: str, name: str, body: str, where: str = "text") -> str:
    """``text`` with ``body`` between the markers of ``name``; a file without them is an error naming it.

    Example:
        >>> replace_between("a\\n" + _begin("x") + "\\nold\\n" + _end("x") + "\\nb", "x", "new").split("\\n")[2]
        'new'
    """
    start, end = _markers(name)
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise SystemExit(f"{where} has no {start} ... {end} markers")
    return text[: i + len(start)] + "\n" + body.strip("\n") + "\n" + text[j:]


def schema_text(current: str) -> str:
    """The paper-card schema ``current`` with its ``weighting`` enum set to the registered weightings.

    Example:
        >>> s = json.dumps({"$defs": {"weighting": {"anyOf": [{"enum": ["old"]}, {"const": "not reported"}]}}})
        >>> "gradcam" in json.loads(schema_text(s))["$defs"]["weighting"]["anyOf"][0]["enum"]
        True
    """
    from vitcam_nb.core.weighting import weighting_names

    schema = json.loads(current)
    choices = schema["$defs"]["weighting"]["anyOf"]
    enum = next(c for c in choices if "enum" in c)
    enum["enum"] = list(weighting_names())
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def generated() -> dict[Path, str]:
    """Every generated file's text as the registries give it now (files are read, nothing is written).

    Example:
        >>> any(p.name == "paper_card.schema.json" for p in generated())
        True
    """
    out: dict[Path, str] = {}
    package_schema = ROOT / SCHEMA_COPIES[0]
    text = schema_text(package_schema.read_text(encoding="utf-8"))
    for rel in SCHEMA_COPIES:
        out[ROOT / rel] = text  # the served copy is the package's, byte for byte
    for rel, name, render in PARTS:
        path = ROOT / rel
        current = out.get(path, path.read_text(encoding="utf-8"))
        out[path] = replace_between(current, name, render(), rel)
    return out


def stale() -> list[str]:
    """The files whose committed text differs from what the registries generate (repository-relative).

    Example:
        >>> stale()  # doctest: +SKIP
        []
    """
    return sorted(str(p.relative_to(ROOT)) for p, text in generated().items()
                  if p.read_text(encoding="utf-8") != text)


def write() -> list[str]:
    """Rewrite every generated part; returns the files that changed.

    Example:
        >>> write()  # doctest: +SKIP
        []
    """
    changed = []
    for path, text in generated().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)))
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: write (or with ``--check`` verify) every generated part.

    Example:
        >>> main(["--check"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale files")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for rel in bad:
            print(f"{rel} is out of date: run python scripts/generate.py", file=sys.stderr)
        return 1 if bad else 0
    for rel in write():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
