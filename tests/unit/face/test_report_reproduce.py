"""Each card of report.html prints its recipe as a line a reader can paste, the recipe id as written, the canonical
id and the trace id; the line parses back to the recipe with absolute layers."""

from __future__ import annotations

import html
import re

import numpy as np
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb import htmlreport


def test_cards_print_the_canonical_line_and_both_ids():
    tr = vc.trace(make_model("vit"), np.random.default_rng(5).integers(0, 255, (32, 32, 3), dtype=np.uint8),
                  targets="top2")
    recipe = vc.Recipe(site="F4", layer=-2, weighting="layercam")
    page = htmlreport.render(tr, [htmlreport.ReportEntry("F4", vc.cam(tr, recipe))])
    line = html.unescape(re.search(r"<p class='reproduce'><code>(.*?)</code>", page).group(1))
    # 3 blocks: -2 is block 1; top1 is the class this trace ranks first
    resolved = recipe.replace(layer=1, class_=int(np.argmax(tr["logits"].values)))
    assert vc.Recipe.parse(line) == resolved == recipe.resolve(tr)
    ids = re.search(r"recipe id (\w+) · canonical id (\w+) · trace (\w+)", page)
    assert ids.groups() == (recipe.id, resolved.id, tr.attrs["trace_id"])
    assert recipe.id != resolved.id


def test_the_methods_paragraph_prints_the_line_the_canonical_id_and_the_trace():
    tr = vc.trace(make_model("vit"), np.random.default_rng(7).integers(0, 255, (32, 32, 3), dtype=np.uint8),
                  targets="top2")
    recipe = vc.Recipe(site="F2", layer=-1, heads="max")
    methods = vc.cam(tr, recipe).attrs["methods"]
    assert methods.startswith(f"Heatmaps were computed with vitcam_nb recipe {recipe.id}")
    line, ids = re.search(r"Recipe as text: (.*?) \(canonical id (\w+); trace (\w+)\)\.$", methods).group(1, 2)
    assert vc.Recipe.parse(line) == recipe.resolve(tr) and ids == recipe.canonical_id(tr)
    assert methods.endswith(f"; trace {tr.attrs['trace_id']}).")
    assert recipe.describe().endswith(f"(canonical id {recipe.id}).")  # without a trace: the recipe as written
