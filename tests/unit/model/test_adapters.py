"""Architecture families with a flat token layout (issue #8): the support matrix, every (family, site) against
the independent reference, a family registered by the user, and the docs adapter example and support matrix.

The families (BEiT, EVA / EVA-02, ViT / DeiT / DINOv2 variants, timm CLIP image towers, and a family registered
by the user) are tiny random-init models described in ``flat_families.py``; the reference, in
``flat_reference.py``, never calls vitcam_nb. Values are compared by coordinate label (``sel(site=...,
layer=..., target=...)``), never by position.

Naming convention (scripts/support_matrix.py measures the support matrix from it): ``test_site_reference``
and ``test_site_not_applicable`` have ids ``"<family>-<site>"``, one family label per matrix row.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flat_families import CORE, FAMILIES, TinyNetAdapter, make_input, registered, tiny_net, vc_trace
from flat_reference import family_run
from vitcam_testing import assert_rel_close, assert_unchanged, snapshot, traced

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter, supported_families, unregister_adapter

ROOT = Path(__file__).resolve().parents[3]


def _matrix(applicable: bool) -> list:
    return [pytest.param(label, site, id=f"{label}-{site}") for label, fam in FAMILIES.items() for site in CORE
            if (site in fam.sites) == applicable]


# --------------------------------------------------------------------------------------------------
# 1. The support matrix: every (family, site) against the reference; sites a family lacks are refused


@pytest.mark.parametrize(("label", "site"), _matrix(True))
def test_site_reference(label, site):
    fam = FAMILIES[label]
    model, _, tr, refs, ref_scores, _, _ = family_run(label)
    assert tr.attrs["model_family"] == (fam.adapter.family if fam.adapter else find_adapter(model).family)
    assert list(tr["layer"].values) == list(range(len(getattr(model, fam.block_list))))
    assert_rel_close(tr["logits"].values, ref_scores, f"{label} logits")
    for target, ref in refs.items():
        for layer in tr["layer"].values:
            act, grad = ref[(int(layer), site)]
            assert_rel_close(traced(tr, site, int(layer)), act, f"{label} act {site}@{layer}")
            assert_rel_close(traced(tr, site, int(layer), target), grad, f"{label} grad {site}@{layer} {target}")
    # the gradients are not trivially zero: a mistake in the hooks could not pass as "0 == 0"
    assert any(np.abs(ref[(0, site)][1]).max() > 0 for ref in refs.values())


@pytest.mark.parametrize(("label", "site"), _matrix(False))
def test_site_not_applicable(label, site):
    fam = FAMILIES[label]
    model, x = fam.build(), make_input(fam)
    before = snapshot(model)
    with pytest.raises(vc.TraceError) as info:
        vc_trace(fam, model, x, sites=[site])
    msg = str(info.value)
    assert msg.startswith("sites:") and f"{site!r}" in msg and "does not have" in msg
    listed = re.search(r"model has (\[.*\])", msg)
    assert listed, f"the refusal should list the model's sites: {msg}"
    for other in CORE:  # every site the family has, and not the refused one
        assert (f"'{other}'" in listed.group(1)) == (other in fam.sites), f"{other} in {listed.group(1)}"
    assert_unchanged(before, model)


# --------------------------------------------------------------------------------------------------
# 6. A user-supplied adapter


def test_unknown_family_refused_with_pointer_to_register_adapter():
    model = tiny_net()
    assert "tinynet" not in supported_families()
    with pytest.raises(TypeError, match=r"TinyNet.*register_adapter"):
        vc.trace(model, torch.randn(1, 3, 24, 24))


def test_custom_adapter_registration_is_undone():
    before = supported_families()
    adapter = TinyNetAdapter()
    with registered(adapter):
        assert supported_families()[0] == "tinynet"
        assert find_adapter(tiny_net()) is adapter
    assert supported_families() == before
    with pytest.raises(ValueError, match="not registered"):
        unregister_adapter(adapter)
    with pytest.raises(ValueError, match="no registered adapter of family 'tinynet'"):
        unregister_adapter("tinynet")


def test_custom_adapter_site_refusal_lists_its_sites():
    class NoF4(TinyNetAdapter):
        def site_table(self, model):
            return {k: v for k, v in self.sites.items() if k != "F4"}

    with registered(NoF4()):
        with pytest.raises(vc.TraceError, match=r"'F4'.*tinynet model has \['F1', 'F2', 'F3', 'F5', 'F6'"):
            vc.trace(tiny_net(), torch.randn(1, 3, 24, 24), sites=["F4"])
    assert "tinynet" not in supported_families()


def _readme_snippet() -> str:
    # the README's "Adding a model family" moved to docs/extending.md's recipe (issue 54)
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text.split("## A model family", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/extending.md: no python block under 'A model family'"
    return blocks[0]


def test_readme_adapter_example_runs():
    before = supported_families()
    namespace: dict = {}
    exec(compile(_readme_snippet(), "extending.md", "exec"), namespace)  # noqa: S102 (our own docs)
    assert supported_families() == before, "the docs example must unregister its adapter"
    tr = namespace["tr"]
    assert tr.attrs["model_family"] == "mynet"
    assert {"act", "grad", "attn", "attn_grad"} <= set(tr.data_vars)
    assert tr.attrs["grid_h"] * tr.attrs["grid_w"] == tr.sizes["token"] - 1


# --------------------------------------------------------------------------------------------------
# 7. The support matrix (docs/models.md) agrees with the adapters


def _readme_matrix() -> dict[str, dict[str, str]]:
    # the matrix moved from the README to docs/models.md, generated by scripts/generate.py (issue 54)
    text = (ROOT / "docs" / "models.md").read_text()
    body = text.split("<!-- BEGIN generated: support-matrix", 1)[1].split("<!-- END generated: support-matrix", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    table = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(header[1:], cells[1:], strict=True))
    return table


def test_readme_support_matrix_matches_site_tables():
    table = _readme_matrix()
    for label, fam in FAMILIES.items():
        assert label in table, f"docs/models.md support matrix lacks {label}; run scripts/support_matrix.py"
        model = fam.build()
        adapter = fam.adapter() if fam.adapter else find_adapter(model)
        sites = adapter.site_table(model)
        for site, cell in table[label].items():
            if cell == "✓":
                assert site in sites, f"docs/models.md: {label} {site} marked working but the adapter lacks it"
            elif cell == "n/a":
                assert site not in sites, f"docs/models.md: {label} {site} marked n/a but the adapter lists it"
        assert {s for s, c in table[label].items() if c == "✓"} | {s for s, c in table[label].items()
                                                                   if c == "n/a"} == set(CORE)
