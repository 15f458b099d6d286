"""Fixtures of the real-browser tests: a JupyterLab server (module scope: started once, killed at the end)
serving a notebook that traces a tiny ViT and displays the widgets, and one Chromium page on it with the
widget cells run through the Lab UI; the server also holds a Notebook 7 copy of the Explorer cell and a
notebook with an Explorer on a many-image store (opened by their tests). Everything skips cleanly when
Chromium or Playwright is missing."""

from __future__ import annotations

import os

import pytest
from lab_harness import (
    LabServer,
    chromium,
    chromium_missing_reason,
    new_page,
    open_notebook,
    run_cell,
    wait_idle,
    write_notebook,
)

# The same tiny model as tests/conftest.py make_model("vit"): O(1) logits, attention and gradients.
SETUP = '''
import math, pathlib
import torch
from timm.models.vision_transformer import VisionTransformer
import vitcam_nb as vc
from vitcam_nb.widgets import Compare, Explorer, Gallery

torch.set_num_threads(1)
torch.manual_seed(0)
model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
                          num_classes=10)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("cls_token", "pos_embed"):
            p.copy_(0.5 * noise)
        elif p.ndim >= 2:
            p.copy_(noise / math.sqrt(p[0].numel()))
        elif "norm" in name and leaf == "weight":
            p.copy_(1.0 + 0.2 * noise)
        else:
            p.copy_(0.1 * noise)
model.eval()
x = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1000))
# Every class label is an injection attempt: the page must show it as text.
labels = [f"<img src=x onerror=alert({i})>#{i}" for i in range(10)]
tr = vc.trace(model, x, labels=labels)
ex = Explorer(tr, vc.Recipe(layer=1))
recipe_log = pathlib.Path("recipes.jsonl")
ex.observe(lambda change: recipe_log.open("a").write(change["new"] + "\\n"), names="recipe_json")
ex
'''
CELLS = [
    SETUP,
    'gal = Gallery(tr, vc.Recipe(), vary=("layer", "site"))\ngal',
    'cmp = Compare(tr, vc.Recipe(layer=1), vc.Recipe(site="F2", layer=1))\ncmp',
    'ex.recipe = vc.Recipe(site="F6", layer=0)',
    "import time\ntime.sleep(2.5)",
]
CELL = {"explorer": 0, "gallery": 1, "compare": 2, "set_recipe": 3, "sleep": 4}

# A second notebook (its own kernel): an Explorer on a three-image trace_many store, with an image picker. The
# matrices are re-drawn at std 0.3 (biases and norms keep timm's init) so that maps are not constant and the
# three images have different top-1 classes (0, 2, 1): switching image rebuilds the class control. The kernel
# logs every frame it shows (image, recipe id, sha256 of ex.map) to store-frames.jsonl.
STORE_SETUP = '''
import hashlib, json, pathlib
import torch
from timm.models.vision_transformer import VisionTransformer
import vitcam_nb as vc

torch.set_num_threads(1)
torch.manual_seed(0)
model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=4)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        if p.ndim >= 2:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
model.eval()
images = [torch.randn((3, 32, 32), generator=torch.Generator().manual_seed(s)) for s in (100, 103, 109)]
path = vc.trace_many(model, images, "store.zarr", targets="top1", progress=False, overwrite=True)
ds = vc.open_traces(path)
ex = vc.Explorer(ds, vc.Recipe(site="F1", layer=0))
frame_log = pathlib.Path("store-frames.jsonl")

def log_frame(change=None):
    entry = {"frame": ex.frame, "index": ex.index, "recipe_id": ex.recipe_id, "error": ex.error,
             "map_sha256": hashlib.sha256(ex.map.tobytes()).hexdigest()}
    with frame_log.open("a") as f:
        f.write(json.dumps(entry) + "\\n")

log_frame()
ex.observe(log_frame, names="frame")
ex
'''
STORE_CELLS = [STORE_SETUP, "ex.index = 0"]
STORE_CELL = {"explorer": 0, "set_index": 1}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = chromium_missing_reason()
    if reason:
        # CI installs Chromium and sets VITCAM_REQUIRE_BROWSER=1: there a missing browser is a failure.
        if os.environ.get("VITCAM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests are required here but cannot run: {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("lab") / "root"
    root.mkdir()
    write_notebook(root / "widgets.ipynb", CELLS)
    write_notebook(root / "notebook7.ipynb", [SETUP.replace("recipes.jsonl", "recipes-nb7.jsonl")])
    write_notebook(root / "store.ipynb", STORE_CELLS)
    with LabServer(root) as server:
        yield server


@pytest.fixture(scope="module")
def browser(lab):
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="module")
def page(lab, browser):
    """The notebook open in Chromium, with the Explorer, Gallery and Compare cells run (Shift+Enter)."""
    page = new_page(browser)
    try:
        open_notebook(page, lab, "widgets.ipynb")
        for name in ("explorer", "gallery", "compare"):
            run_cell(page, CELL[name])
        page.wait_for_selector(".vc-explorer[data-ready='true']", timeout=90_000)
        page.wait_for_selector(".vc-gallery[data-ready='true']", timeout=60_000)
        page.wait_for_selector(".vc-compare[data-ready='true']", timeout=60_000)
        wait_idle(page)
        yield page
    finally:
        page.close()


@pytest.fixture(scope="module")
def cells():
    return CELL


@pytest.fixture(scope="module")
def store_cells():
    return STORE_CELL
