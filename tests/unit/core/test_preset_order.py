"""``vc.presets.names()`` lists the presets in one order whichever preset module a process imported first (the
package is lazy, and the published presets register from several modules); the docs table and the menus follow it.
Each order is read in a fresh interpreter."""

import json
import subprocess
import sys

import pytest

FIRST = ["vitcam_nb.core.presets_rules", "vitcam_nb.core.presets_tokentm", "vitcam_nb.core.presets_attention",
         "vitcam_nb.core.preset_taxonomy"]


def _names_after(module: str) -> list[str]:
    code = f"import {module}\nfrom vitcam_nb.core.presets import names\nprint(__import__('json').dumps(names()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", FIRST)
def test_the_presets_are_listed_in_the_taxonomys_order_whatever_was_imported_first(module):
    from vitcam_nb.core.preset_taxonomy import TAXONOMY

    assert _names_after(module) == list(TAXONOMY)
