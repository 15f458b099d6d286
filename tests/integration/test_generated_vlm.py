"""docs/vlm.md's family and preset tables come from the registries (``scripts/generate.py`` with
``scripts/vlm_tables.py``): a VLM family row registered from its own module shows up with its layout's words and
its classes leave the refused list; removed, it leaves the page. Containment and behaviour, never an exact list."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from vitcam_nb.adapters import hf_vlm  # noqa: E402
from vitcam_nb.core.presets_vlm import VLM_TAXONOMY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vitcam_generate_vlm", ROOT / "scripts" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = generate
_spec.loader.exec_module(generate)


def _page() -> str:
    return generate.generated()[ROOT / "docs" / "vlm.md"]


def _probe_layout(model, ids, grid, extra=None):
    """Probe layout: tokens in a spiral | with a pipe (:func:`~vitcam_nb.adapters.vlm_layout.image_positions`).

    A second paragraph that the table leaves out.
    """


def test_the_committed_page_is_what_the_registries_give():
    assert "docs/vlm.md" not in generate.stale(), "run: python scripts/generate.py"
    page = _page()
    for name, fam in hf_vlm.VLM_FAMILIES.items():
        assert f"| `{name}` | " in page and all(f"`{c}`" in page for c in fam.classes)
    for cls in hf_vlm.NOT_YET_SUPPORTED:
        assert f"- `{cls}` (`{hf_vlm.NOT_YET_SUPPORTED[cls]}`): " in page
    assert all(f"| `{name}` | " in page for name in VLM_TAXONOMY)


def test_a_registered_family_reaches_the_table_and_its_classes_leave_the_refused_list():
    # a class refused by name now (once every known family is read, a made-up class: nothing to leave)
    cls = next(iter(hf_vlm.NOT_YET_SUPPORTED), "ZzProbeForConditionalGeneration")
    family = hf_vlm.NOT_YET_SUPPORTED.get(cls, "zz_none")
    saved = (dict(hf_vlm.NOT_YET_SUPPORTED), hf_vlm.HfVlmAdapter.classes)
    row = hf_vlm.VlmFamily("zz_probe_vlm", (cls,), tower="a.tower", projector="a.proj", lm_layers="a.layers",
                           layout=_probe_layout, reads="probe reads", crops=True)
    hf_vlm.register_vlm_family(row)
    try:
        page = _page()
        line = next(x for x in page.splitlines() if x.startswith("| `zz_probe_vlm` |"))
        assert f"`{cls}`" in line and "`a.tower` · `a.proj` · `a.layers`" in line and "probe reads" in line
        # the layout's first docstring paragraph, its role as a code name, its pipe escaped
        assert "Probe layout: tokens in a spiral &#124; with a pipe (`image_positions`)." in line
        assert "second paragraph" not in line and line.endswith("| yes: one tower row per crop |")
        assert f"- `{cls}` (`{family}`)" not in page
    finally:
        hf_vlm.VLM_FAMILIES.pop("zz_probe_vlm")
        hf_vlm.NOT_YET_SUPPORTED.clear()
        hf_vlm.NOT_YET_SUPPORTED.update(saved[0])
        hf_vlm.HfVlmAdapter.classes = saved[1]
    page = _page()
    assert "zz_probe_vlm" not in page and (f"- `{cls}` (`{family}`)" in page) == (cls in hf_vlm.NOT_YET_SUPPORTED)
