"""The figures people look at (vitcam_nb/plot.py, evaluate.plot_atlas, Ambiguity.plot, the report's layout): the
Figure objects are inspected, not only drawn. Titles name the recipe in words and the class, a colour bar exists,
the default colormap is perceptually uniform, gallery columns run F1..F6, the object's outline is drawn where the
mask lies, the input image sits beside the maps, and a blank (all-zero) map says why it is blank."""

from __future__ import annotations

import json
import re
from html import escape

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import vitcam_nb as vc  # noqa: E402
from vitcam_nb import evaluate, htmlreport, plot  # noqa: E402
from vitcam_nb.demo import _scores  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning",
                                        "ignore::vitcam_nb.evaluate.MetricWarning")


@pytest.fixture(scope="module")
def shapes():
    """The bundled shapes model on its first sample image (a circle), with the circle's mask."""
    if "shapes-vit" not in vc.models.bundled_names():
        pytest.skip("bundled model shapes-vit is not available")
    img, _label, mask = vc.models.sample_image("shapes", 0, with_mask=True)
    tr = vc.trace(vc.models.load_model("shapes-vit"), img)
    return tr, np.asarray(mask, bool)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _top_class(tr):
    return str(tr["class_label"].values[int(np.argmax(tr["logits"].values))])


def _contour_bbox(ax):
    """Bounding box (x0, y0, x1, y1) of every contour line drawn on ``ax``, or None when none is."""
    points = [p.vertices for c in ax.collections for p in c.get_paths() if len(p.vertices)]
    if not points:
        return None
    v = np.concatenate(points)
    return v[:, 0].min(), v[:, 1].min(), v[:, 0].max(), v[:, 1].max()


def _assert_outlines(ax, mask):
    """The 0.5 contour of the mask at pixel centres lies within one pixel outside the mask's extreme pixels."""
    box = _contour_bbox(ax)
    assert box is not None, "no mask outline drawn"
    ys, xs = np.nonzero(mask)
    x0, y0, x1, y1 = box
    assert xs.min() - 1 <= x0 <= xs.min() and ys.min() - 1 <= y0 <= ys.min()
    assert xs.max() <= x1 <= xs.max() + 1 and ys.max() <= y1 <= ys.max() + 1


def test_recipe_short_names_the_choices_in_words():
    assert plot.recipe_short(vc.Recipe()) == "gradcam · F1 · last block · logit"
    assert plot.recipe_short(vc.Recipe(site="F4", layer=0, relu="none")) == "gradcam · F4 · block 0 · logit · relu=none"
    assert plot.recipe_short(vc.Recipe(layer=(0, 2), layer_fusion="mean").to_json()) == \
        "gradcam · F1 · blocks 0+2 · logit · layer_fusion=mean"


def test_gallery_grid_columns_F1_to_F6_with_input_colour_bar_outline_and_reasons(shapes):
    tr, mask = shapes
    g = vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": "all"})
    assert list(g["site"].values) != sorted(g["site"].values)  # the trace's capture order is not reading order
    fig = plot.grid(tr, g, mask=mask)
    axes = np.array(fig.axes[:-1]).reshape(g.sizes["layer"], g.sizes["site"] + 1)
    sites = [f"F{i}" for i in range(1, 7)]
    assert [ax.get_title() for ax in axes[0, 1:]] == [f"site {s}" for s in sites]
    for i, layer in enumerate(g["layer"].values):
        assert axes[i, 1].get_ylabel() == f"block {layer}"
        for j, site in enumerate(sites):
            shown = np.asarray(axes[i, j + 1].images[1].get_array())
            np.testing.assert_array_equal(shown, g.sel(layer=layer, site=site).values)
            assert axes[i, j + 1].images[1].get_cmap().name == "inferno"
            reason = str(g.sel(layer=layer, site=site)["degenerate"].values)
            texts = " ".join(t.get_text().replace("\n", " ") for t in axes[i, j + 1].texts)
            if reason:
                assert texts.startswith("all zeros:") and reason.split(" (")[0][:18] in texts
            else:
                assert texts == ""
    assert any(str(g["degenerate"].values[i, j]) for i in range(g.sizes["layer"]) for j in range(g.sizes["site"]))
    np.testing.assert_array_equal(np.asarray(axes[0, 0].images[0].get_array()), tr["image"].values)
    assert axes[0, 0].get_title() == "input (object outlined)"
    for ax in (axes[0, 0], axes[2, 3]):
        _assert_outlines(ax, mask)
    cbar = fig.axes[-1]
    assert cbar.get_ylabel() == "map value" and cbar.get_ylim() == (0.0, 1.0)  # the colour bar: its solids
    solids = [c for c in cbar.collections if c.get_array() is not None and np.size(c.get_array()) > 1]
    assert [c.get_cmap().name for c in solids] == ["inferno"]
    title = fig._suptitle.get_text()
    assert "gradcam · F1 · last block · logit" in title and f"class {_top_class(tr)}" in title
    assert "layer, site" in title


def test_grid_without_mask_draws_no_outline_and_keeps_a_chosen_cmap(shapes):
    tr, _mask = shapes
    g = vc.gallery(tr, vc.Recipe(), vary={"site": ["F4", "F1"]})
    fig = plot.grid(tr, g, cmap="viridis")
    assert [ax.get_title() for ax in fig.axes[1:3]] == ["site F1", "site F4"]
    assert all(_contour_bbox(ax) is None for ax in fig.axes[:3])
    assert fig.axes[1].images[1].get_cmap().name == "viridis"


def test_overlay_has_words_colour_bar_outline_and_uniform_default(shapes):
    tr, mask = shapes
    m = vc.cam(tr, vc.Recipe(site="F4", layer=0))
    fig = plot.overlay(tr, m, mask=mask)
    ax, cbar = fig.axes
    assert ax.get_title() == f"gradcam · F4 · block 0 · logit\nclass {_top_class(tr)}"
    assert not re.fullmatch(r"recipe [0-9a-f]{12}", ax.get_title())
    assert ax.images[1].get_cmap().name == plot.DEFAULT_CMAP == "inferno"
    assert cbar.get_ylabel() == "map value" and ax.images[1].get_clim() == (0, 1)
    _assert_outlines(ax, mask)
    zeros = vc.cam(tr, vc.Recipe(site="F6", layer=-1))
    assert zeros.attrs["degenerate"]
    assert "DEGENERATE: map is all zeros" in plot.overlay(tr, zeros).axes[0].get_title()


def test_class_name_follows_the_recipe_class(shapes):
    tr, _ = shapes
    order = np.argsort(-tr["logits"].values, kind="stable")
    labels = tr["class_label"].values
    assert plot.class_name(tr, vc.Recipe(class_="top2")) == labels[order[1]]
    assert plot.class_name(tr, vc.Recipe(class_=int(order[0]))) == labels[order[0]]


def test_atlas_says_why_a_row_is_empty(shapes):
    tr, _ = shapes
    recipes = {"F1 last": vc.Recipe(), "F4 first": vc.Recipe(site="F4", layer=0),
               "F2 first": vc.Recipe(site="F2", layer=0), "F6 last": vc.Recipe(site="F6", layer=-1)}
    at = evaluate.atlas(tr, recipes)
    assert np.isnan(at.values[3]).all()
    fig = evaluate.plot_atlas(at)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "F6 last"
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[-1] == "F6 last (all zeros)" and sum("(all zeros)" in t for t in ticks) == 1
    reason = vc.cam(tr, recipes["F6 last"]).attrs["degenerate"].split(" (")[0]
    row = [t for t in ax.texts if "map is all zeros" in t.get_text()]
    assert len(row) == 1 and row[0].get_position()[1] == 3 and reason in row[0].get_text()
    title = fig.axes[2].get_title()
    assert "4 variants agree" in title and "1 variant(s) give an all-zero map" in title
    assert "spearman" in fig.axes[1].get_ylabel()  # the colour bar


def test_ambiguity_figure_shows_image_mask_and_how_zeros_count(shapes):
    tr, mask = shapes
    amb = vc.ambiguity(tr, reported=dict(layer=-1, weighting="gradcam", target="logit", weight_tokens="patch",
                                         relu="after"), mask=mask)
    maps = amb.maps.values
    zeros = int((~maps.reshape(len(maps), -1).any(axis=1)).sum())
    assert zeros > 0 and amb.degenerate == zeros
    fig = amb.plot()
    image_ax, mean_ax, spread_ax = fig.axes[0], fig.axes[1], fig.axes[2]
    np.testing.assert_array_equal(np.asarray(image_ax.images[0].get_array()), tr["image"].values)
    assert image_ax.get_title() == "input image (object outlined)"
    np.testing.assert_allclose(np.asarray(mean_ax.images[0].get_array()), maps.astype(np.float64).mean(axis=0))
    assert f"mean of the {len(maps)} maps\n({zeros} all-zero map(s) counted as zeros)" == mean_ax.get_title()
    assert f"{zeros} all-zero map(s) counted as zeros" in spread_ax.get_title()
    assert all(ax.images[0].get_cmap().name == "inferno" for ax in fig.axes[1:5] if ax.images)
    for ax in fig.axes[:5]:
        if ax.images and ax.images[0].get_array().shape[:2] != (len(amb.sensitivity.fields),):
            _assert_outlines(ax, mask)
    assert len(fig.axes) == 10  # six panels and four colour bars
    suptitle = fig._suptitle.get_text()
    assert f"{len(amb.recipes)} distinct recipes" in suptitle and f"{amb.sensitivity.cells} combinations" in suptitle
    text = amb.report()
    assert f"{zeros} map(s) were degenerate (returned as zeros): they count as zeros in the mean" in text
    assert "left out of the Spearman pairs" in text and "count as misses" in text
    assert f"{amb.sensitivity.cells} combinations of the open values name them" in text


def test_report_shows_provenance_once_and_folds_checklists(shapes):
    tr, mask = shapes
    recipes = {"F1 last": vc.Recipe(), "F4 first": vc.Recipe(site="F4", layer=0)}
    entries = [htmlreport.ReportEntry(k, vc.cam(tr, r)) for k, r in recipes.items()]
    html = htmlreport.render(tr, entries, mask=mask)
    assert html.count("<section class='provenance'>") == 1
    assert html.count("<th colspan='2'>model and input</th>") == 1  # not repeated in each card
    shared = json.loads(entries[0].cam_map.attrs["checklist"])["model and input"]
    assert all(escape(str(v)) in html for v in shared.values())
    cards = re.findall(r"<div class='card[^']*' data-recipe-id='([0-9a-f]{12})'>(.*?)</div></div>", html, re.S)
    assert [rid for rid, _ in cards] == [r.id for r in recipes.values()]
    for (_, body), label in zip(cards, recipes, strict=True):
        assert f"<h3>{label} · class {escape(_top_class(tr))} <span" in body
        assert re.search(r"<details><summary>checklist \(\d+ categories\)</summary><table class='checklist'>", body)
        assert "model and input" not in body


def test_demo_scores_show_energy_pointing_game_only_where_it_differs(shapes):
    tr, mask = shapes
    m = vc.cam(tr, vc.Recipe(site="F4", layer=0))
    v = m.values.astype(np.float64)
    mass = v[mask].sum() / v.sum()  # min-max map: minimum 0, so both scores are this share of the map's sum
    scores = _scores(m, mask)
    assert list(scores) == ["pointing game", "AUROC", "audit label", "relevance mass"]
    assert scores["relevance mass"] == pytest.approx(mass, rel=1e-6)
    signed = vc.cam(tr, vc.Recipe(site="F4", layer=0, relu="none", normalize="none"))
    s = signed.values.astype(np.float64)
    assert s.min() < 0
    scores = _scores(signed, mask)
    assert list(scores) == ["pointing game", "AUROC", "audit label", "energy pointing game", "relevance mass"]
    e = (s - s.min()) / np.ptp(s)
    assert scores["energy pointing game"] == pytest.approx(e[mask].sum() / e.sum(), rel=1e-6)
    assert scores["relevance mass"] == pytest.approx(np.maximum(s, 0)[mask].sum() / np.maximum(s, 0).sum(), rel=1e-6)
