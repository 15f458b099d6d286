"""Issue 52 (Reliability IV), second battery, M3: ``class_="topK"`` and the class index it resolves to are one map
and one canonical id where the trace ranks one class K-th; where the images of a store rank different classes
K-th, ``"topK"`` is a map of its own and keeps its own id."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.recipe_canonical import ranked_class

MODEL = vc.load_model("shapes-vit")
IMAGE = vc.sample_image("shapes", 0)
TRACE = vc.trace(MODEL, IMAGE, targets="top2")


def _map(trace: object, recipe: Recipe) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(vc.cam(trace, recipe).values).tobytes()


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("fields", [{}, {"target": "prob", "layer": (0, 5), "layer_fusion": "mean"},
                                    {"site": "F2", "layer": (2, 5), "layer_fusion": "grad_rollout"}])
def test_top_k_and_the_class_the_trace_ranks_k_th_are_one_map_and_one_id(rank, fields):
    # The battery's reproducer: the K-th class by logit, computed here with NumPy from the stored logits.
    explicit = int(np.argsort(-TRACE["logits"].values.astype(np.float64), kind="stable")[rank - 1])
    top, named = Recipe(class_=f"top{rank}", **fields), Recipe(class_=explicit, **fields)
    assert _map(TRACE, top) == _map(TRACE, named)
    assert top.canonical_id(TRACE) == named.canonical_id(TRACE) == named.resolve(TRACE).id
    other = int(np.argsort(-TRACE["logits"].values.astype(np.float64), kind="stable")[2 - rank])
    assert top.canonical_id(TRACE) != Recipe(class_=other, **fields).canonical_id(TRACE)


def test_ranked_class_breaks_ties_in_class_order_and_needs_one_class_for_all_images():
    assert ranked_class(np.array([1.0, 3.0, 3.0, 0.0]), 1) == 1 and ranked_class(np.array([1.0, 3.0, 3.0]), 2) == 2
    assert ranked_class(np.array([[0.0, 2.0, 1.0], [0.5, 3.0, 0.0]]), 1) == 1  # both images rank class 1 first
    assert ranked_class(np.array([[0.0, 2.0, 1.0], [0.5, 3.0, 0.0]]), 2) is None  # class 2, then class 0
    assert ranked_class(np.array([1.0, 2.0]), 3) is None


def _two_images_ranking(first_same: bool) -> list[np.ndarray]:
    """Two sample images whose top-1 classes are the same (or differ), from the shapes samples."""
    by_class: dict[int, np.ndarray] = {}
    for i in range(12):
        img = vc.sample_image("shapes", i)
        cls = int(np.argmax(vc.trace(MODEL, img, targets="top1")["logits"].values))
        if first_same and cls in by_class:
            return [by_class[cls], img]
        by_class.setdefault(cls, img)
        if not first_same and len(by_class) == 2:
            return list(by_class.values())
    pytest.skip("the shapes samples lack such a pair")


@pytest.mark.parametrize("same", [True, False])
def test_a_store_resolves_top1_only_where_every_image_ranks_one_class_first(tmp_path, same):
    images = _two_images_ranking(same)
    store = vc.open_traces(vc.trace_many(MODEL, images, tmp_path / "t.zarr", targets="top5", sites=["F1"],
                                        progress=False))
    firsts = {int(np.argmax(vc.trace(MODEL, img, targets="top1")["logits"].values)) for img in images}
    top = Recipe()
    if same:
        (cls,) = firsts
        assert top.canonical_id(store) == Recipe(class_=cls).canonical_id(store)
        assert _map(store, top) == _map(store, Recipe(class_=cls))
    else:  # one class per image: a map of its own, unlike either class's
        assert top.canonical_id(store) == Recipe(layer=5).id
        for cls in firsts:
            assert top.canonical_id(store) != Recipe(class_=cls).canonical_id(store)
            assert _map(store, top) != _map(store, Recipe(class_=cls))
