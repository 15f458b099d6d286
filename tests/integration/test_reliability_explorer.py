"""Issue #36, the Explorer's controls and badges. The exported page's stand-in for the kernel (standalone.js's
localModel, run in node on a real bundle) refuses a draft the file does not hold, also in a field the file does
not vary (e.g. a preset's ReLU or upsampling), instead of showing the entry of its varied fields as if it were
that recipe; and a degenerate map names its cause. The browser side (controls back at the shown recipe after a
refusal, for every preset, in both kinds of Explorer) is tests/ui/test_explorer_presets.py."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import warnings
import zlib

import numpy as np
import pytest
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.widgets import assets
from vitcam_nb.widgets.bundle import build_bundle

NODE = shutil.which("node")
MODEL = make_model("vit")  # 3 blocks, CLS pooling
TR = vc.trace(MODEL, np.random.default_rng(8).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top1")


def answers(drafts: list[dict], tmp_path) -> list[dict]:
    """What the exported page's local model answers to each draft (sent in turn, like the Explorer does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        bundle = build_bundle(TR, vc.Recipe(layer=1), axes={"site": ["F1", "F4"], "weighting": ["gradcam"],
                                                            "target": ["logit"]}, quantize="float32", progress=False)
    code = (assets.STATIC_DIR / "core.js").read_text() + (assets.STATIC_DIR / "standalone.js").read_text()
    module = tmp_path / "page.mjs"
    module.write_text(code.replace("\nmountExported();", "\nexport { localModel };"))  # no document in node
    script = tmp_path / "run.mjs"
    script.write_text(
        f"import {{ localModel }} from {json.dumps(str(module))};\nimport fs from 'fs';\n"
        "const { meta, maps, entries, drafts } = JSON.parse(fs.readFileSync(0, 'utf8'));\n"
        "const model = localModel([{ name: '', meta, maps: Uint8Array.from(Buffer.from(maps, 'base64')), entries }]);\n"
        "const out = drafts.map((recipe, i) => { model.set('request', { id: i + 1, recipe, changed: [] });\n"
        "  model.save_changes();\n"
        "  return { id: model.get('recipe_id'), error: model.get('error'), answered: model.get('response_id') }; });\n"
        "console.log(JSON.stringify(out));\n")
    payload = {"meta": bundle.meta, "maps": base64.b64encode(zlib.decompress(base64.b64decode(bundle.maps))).decode(),
               "entries": json.loads(zlib.decompress(base64.b64decode(bundle.texts))), "drafts": drafts}
    out = subprocess.run([NODE, str(script)], input=json.dumps(payload), capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_exported_page_refuses_a_preset_whose_fixed_fields_the_file_does_not_hold(tmp_path):
    start = vc.Recipe(layer=1)
    f4 = start.replace(site="F4")
    rollout = vc.presets.attention_rollout()  # F2: a site the file does not vary over
    drafts = [f4.to_dict(), json.loads(rollout.to_json()), {**start.to_dict(), "relu": "none"},
              {**f4.to_dict(), "upsample": "nearest", "normalize": "max"}, start.to_dict()]
    got = answers(drafts, tmp_path)
    assert [g["answered"] for g in got] == [1, 2, 3, 4, 5]
    assert got[0] == {"id": f4.id, "error": "", "answered": 1}
    assert got[1]["id"] == f4.id and got[1]["error"].startswith('site = "F2" is not in this file')
    # Fields the file does not vary: the old page showed the entry of the varied fields (relu "after", bilinear,
    # minmax) as the answer to these drafts, under that entry's id.
    assert got[2] == {"id": f4.id, "error": 'relu = "none" is not in this file (it holds "after" only)', "answered": 3}
    assert got[3] == {"id": f4.id, "error": 'upsample = "nearest" is not in this file (it holds "bilinear" only)',
                      "answered": 4}
    assert got[4] == {"id": start.id, "error": "", "answered": 5}


def test_a_degenerate_map_names_its_cause_in_its_attrs_and_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = vc.cam(TR, vc.Recipe(site="F6", layer=-1))  # CLS pooling: the last block's patch tokens get no gradient
    assert m.attrs["degenerate"].startswith("gradients are exactly zero at these tokens")
    assert m.attrs["degenerate_cause"] == "zero gradient"
    messages = [str(w.message) for w in caught if issubclass(w.category, vc.DegenerateMapWarning)]
    assert len(messages) == 1 and messages[0].startswith("zero gradient: recipe ")
