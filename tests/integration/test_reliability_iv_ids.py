"""Issue 52 (Reliability IV), findings 2 and 3 and the recipe LOWs: canonical ids are one id per map.

``Recipe.canonical_id(trace)`` is the id of ``Recipe.resolve(trace)``: ``"all"`` is the blocks the trace holds,
tuples of an order-free fusion or of a rollout are sorted (``vc.cam`` fuses and multiplies in block order), one
block is unfused, and a recipe ``vc.cam`` refuses on the trace is refused with ``vc.cam``'s own error. The property
test draws pairs of recipes (many of them two spellings of one map) on three kinds of trace and checks, against
``vc.cam``'s maps compared byte for byte, that two recipes share a canonical id if and only if their maps are the
same.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import timm
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import vitcam_nb as vc
from vitcam_nb import Recipe

IMAGE = np.random.default_rng(52).integers(0, 256, (64, 64, 3), dtype=np.uint8)
SHAPES = vc.load_model("shapes-vit")  # 6 blocks
FULL = vc.trace(SHAPES, IMAGE, targets="top2")
SUBSET = vc.trace(SHAPES, IMAGE, targets="top2", layers=[0, 2, 4])


def _swin() -> object:
    torch.manual_seed(0)  # fixed weights: the same trace on every run
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 2), num_heads=(2, 4),
                              embed_dim=16, img_size=56, window_size=7).eval()
    img = np.random.default_rng(7).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    return vc.trace(model, img, targets="top1", sites=["F1", "F4"])


SWIN = _swin()  # stages of 1 and 2 blocks: global blocks 0 | 1, 2


def _top1(trace: object) -> int:
    """The class a trace ranks first (its argmax logit): what ``class_="top1"`` resolves to on it."""
    return int(np.argmax(np.asarray(trace["logits"].values)))


def _map(trace: object, recipe: Recipe) -> tuple[bytes, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = vc.cam(trace, recipe)
    return m.values.tobytes(), m.attrs["degenerate"]


# -- finding 2: "all" is the trace's blocks ----------------------------------------------------------------------------
def test_all_names_the_blocks_the_trace_holds():
    every = Recipe(layer="all", layer_fusion="mean")
    # Before: one id on a trace of blocks 0..5 and on a trace of 0, 2, 4, whose maps differ.
    assert _map(FULL, every)[0] != _map(SUBSET, every)[0]
    assert every.canonical_id(FULL) != every.canonical_id(SUBSET)
    assert every.canonical_id(SUBSET) == Recipe(layer=(0, 2, 4), layer_fusion="mean").canonical_id(SUBSET) == \
        Recipe(layer=(0, 2, 4), layer_fusion="mean", class_=_top1(SUBSET)).id
    assert every.canonical_id(FULL) == Recipe(layer=tuple(range(6)), layer_fusion="mean", class_=_top1(FULL)).id
    assert _map(SUBSET, every) == _map(SUBSET, Recipe(layer=(4, -6, 2), layer_fusion="mean"))


# -- finding 3: order, "all" and one block -----------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", [Recipe(layer=(5, 0), layer_fusion="mean"),
                                    Recipe(layer=(5, 0, 3), layer_fusion="max"),
                                    Recipe(site="F4", layer=(4, 1, 2), layer_fusion="sum", normalize="none"),
                                    Recipe(site="F2", layer=(5, 0), layer_fusion="rollout"),
                                    Recipe(site="F2", layer=(5, 2, 0), layer_fusion="grad_rollout")])
def test_block_order_is_one_map_and_one_id(recipe):
    ordered = recipe.replace(layer=tuple(sorted(recipe.layer)))
    # top1 is the trace's argmax class, but in an attention rollout, which has no class
    resolved = ordered if ordered.layer_fusion == "rollout" else ordered.replace(class_=_top1(FULL))
    assert recipe.canonical_id(FULL) == ordered.canonical_id(FULL) == resolved.id
    assert _map(FULL, recipe) == _map(FULL, ordered)  # bitwise: vc.cam fuses and multiplies in block order


def test_one_block_is_that_block_unfused():
    plain = Recipe(site="F4", layer=3)
    for spelling in (Recipe(site="F4", layer=(3,), layer_fusion="mean"),
                     Recipe(site="F4", layer=-3, layer_fusion="max"),
                     Recipe(site="F4", layer=(-3,), layer_fusion="sum")):
        assert spelling.canonical_id(FULL) == plain.replace(class_=_top1(FULL)).id
        assert _map(FULL, spelling) == _map(FULL, plain)


@pytest.mark.parametrize("trace, recipe", [
    (SUBSET, Recipe(layer=5)),                                       # a block this trace does not hold
    (SUBSET, Recipe(layer=(0, 1), layer_fusion="mean")),
    (FULL, Recipe(layer=6)),                                         # out of range
    (FULL, Recipe(layer="1.0")),                                     # a stage.block on a flat trace
    (FULL, Recipe(layer=(1, -5), layer_fusion="mean")),              # one block twice
    (SWIN, Recipe(site="F2", layer=(0, 1), layer_fusion="rollout")),  # a rollout over windows and merges
    (SWIN, Recipe(site="F3", layer=0)),                              # a site the trace does not hold
    (FULL, Recipe(site="F1", class_=9)),                             # a class the model does not have
])
def test_canonical_id_refuses_what_cam_refuses_with_its_error(trace, recipe):
    with pytest.raises(vc.VitcamError) as by_cam:
        vc.cam(trace, recipe)
    with pytest.raises(type(by_cam.value)) as by_id:
        recipe.canonical_id(trace)
    assert str(by_id.value) == str(by_cam.value)


@pytest.mark.parametrize("trace", [None, {}, [1, 2], "trace.zarr"])
def test_canonical_id_of_no_trace_is_a_kit_error_naming_it(trace):
    with pytest.raises(vc.ArgumentTypeError, match="^trace: expected a trace"):
        Recipe().canonical_id(trace)
    with pytest.raises(vc.ArgumentTypeError, match="^trace: "):
        Recipe().resolve(trace)


def test_stage_block_addresses_resolve_to_the_global_blocks():
    assert Recipe(layer=("1.-1", "0.0"), layer_fusion="mean").canonical_id(SWIN) == \
        Recipe(layer=(0, 2), layer_fusion="mean", class_=_top1(SWIN)).id == \
        Recipe(layer=(2, 0), layer_fusion="mean").canonical_id(SWIN)
    assert Recipe(layer="all", layer_fusion="max").canonical_id(SWIN) == \
        Recipe(layer=(0, 1, 2), layer_fusion="max", class_=_top1(SWIN)).id


# -- the property: one canonical id iff one map ------------------------------------------------------------------------
def _no_prefix() -> object:
    """A 3-block ViT without a class token (every token a patch, as on a video model): ``weight_tokens="all"`` and
    ``"patch"`` pool the same tokens there."""
    torch.manual_seed(52)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                          embed_dim=32, num_heads=2, num_classes=4, class_token=False, global_pool="avg").eval()
    return vc.trace(m, IMAGE[:32, :32], targets="top2")


NO_PREFIX = _no_prefix()
KINDS = {"flat": (FULL, 6, False), "subset": (SUBSET, 6, False), "swin": (SWIN, 3, True),
         "no_prefix": (NO_PREFIX, 3, False)}
# The classes each trace ranks 1st, 2nd, ... by logit (ties in class order), as traced: top2 on the flat traces.
RANKED = {kind: [int(c) for c in np.argsort(-np.asarray(KINDS[kind][0]["logits"].values, np.float64),
                                            kind="stable")[:(1 if kind == "swin" else 2)]] for kind in KINDS}
SWIN_ADDRESS = {0: ("0.0", "0.-1"), 1: ("1.0", "1.-2"), 2: ("1.1", "1.-1")}


@st.composite
def _recipe(draw: st.DrawFn, n: int, stages: bool, ranked: list[int], base: dict | None = None) -> tuple[dict, Recipe]:
    """A recipe's meaning (site, fusion, blocks, normalisation, class rank) and one spelling of it; ``base``: spell
    that one. The class of rank k is spelled ``"topk"`` or as the class index the trace ranks k-th."""
    if base is None:
        fusion = draw(st.sampled_from(["none", "mean", "sum", "max", "rollout", "grad_rollout"]))
        site = "F2" if fusion in ("rollout", "grad_rollout") else draw(st.sampled_from(["F1", "F4"]))
        # A sum differs from a mean only by a scale a normalisation removes: the sum is drawn unnormalised.
        normalize = "none" if fusion == "sum" else draw(st.sampled_from(["minmax", "none"]))
        count = 1 if fusion == "none" else draw(st.integers(1, 3))
        blocks = "all" if fusion != "none" and draw(st.booleans()) and draw(st.booleans()) else \
            tuple(sorted(draw(st.sets(st.integers(0, n - 1), min_size=count, max_size=count))))
        rank = draw(st.integers(1, len(ranked)))
        base = {"site": site, "fusion": fusion, "blocks": blocks, "normalize": normalize, "rank": rank}
    fusion, blocks = base["fusion"], base["blocks"]
    class_ = f"top{base['rank']}" if draw(st.booleans()) else ranked[base["rank"] - 1]
    if fusion == "rollout":
        class_ = "top1"  # an attention rollout has no class: a Recipe refuses any other

    addresses = stages and draw(st.booleans())  # a tuple holds block indices or stage.block addresses, not both

    def spell(b: int) -> object:
        if addresses:
            return draw(st.sampled_from(SWIN_ADDRESS[b]))
        return b - n if draw(st.booleans()) else b

    if blocks == "all":
        layer: object = "all"
    else:
        layer = tuple(draw(st.permutations([spell(b) for b in blocks])))
        if len(layer) == 1 and (fusion == "none" or draw(st.booleans())):
            layer = layer[0]
    if fusion == "none" and isinstance(layer, tuple):
        fusion = "mean"
    if fusion in ("mean", "sum", "max") and not isinstance(layer, tuple) and layer != "all" and draw(st.booleans()):
        fusion = "none"  # one block: any order-free fusion is the block's own map
    return base, Recipe(site=base["site"], layer=layer, layer_fusion=fusion, normalize=base["normalize"],
                        class_=class_)


@st.composite
def _pair(draw: st.DrawFn, kind: str) -> tuple[Recipe, Recipe]:
    _, n, stages = KINDS[kind]
    base, a = draw(_recipe(n, stages, RANKED[kind]))
    _, b = draw(_recipe(n, stages, RANKED[kind], base if draw(st.booleans()) else None))
    if kind == "no_prefix":  # without prefix tokens "all" is "patch": two spellings of one map (not of a rollout)
        a, b = (r if r.layer_fusion in ("rollout", "grad_rollout") else
                r.replace(weight_tokens=draw(st.sampled_from(["patch", "all"]))) for r in (a, b))
    return a, b


def _outcome(trace: object, recipe: Recipe) -> tuple[str, object, object]:
    """("map", canonical id, (bytes, degenerate)) or ("refused", cam's error, canonical_id's error)."""
    try:
        made = _map(trace, recipe)
    except vc.VitcamError as exc:
        with pytest.raises(type(exc)) as again:
            recipe.canonical_id(trace)
        return "refused", str(exc), str(again.value)
    return "map", recipe.canonical_id(trace), made


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_one_canonical_id_if_and_only_if_one_map(kind, data):
    trace = KINDS[kind][0]
    a, b = data.draw(_pair(kind))
    got_a, got_b = _outcome(trace, a), _outcome(trace, b)
    for got in (got_a, got_b):
        if got[0] == "refused":
            assert got[1] == got[2]  # canonical_id refuses with vc.cam's own error
    if got_a[0] != "map" or got_b[0] != "map":
        event("refused by vc.cam and canonical_id alike")
        return
    same_id, same_map = got_a[1] == got_b[1], got_a[2][0] == got_b[2][0]
    event(f"same id: {same_id}, same map: {same_map}")  # --hypothesis-show-statistics: both kinds of pair occur
    assert not same_id or same_map, (a, b)
    # Two degenerate maps are both returned as zeros, whatever their recipes: only real maps identify a recipe.
    if same_map and not got_a[2][1] and not got_b[2][1]:
        assert same_id, (a, b)


# -- LOWs: mixed layer tuples, non-ASCII digits ------------------------------------------------------------------------
def test_a_tuple_mixing_block_indices_and_stage_addresses_is_refused():
    with pytest.raises(vc.RecipeError, match="^layer: a tuple must hold block indices or 'stage.block' addresses"):
        Recipe(layer=(0, "1.0"), layer_fusion="mean")
    assert Recipe(layer=("0.0", "1.0"), layer_fusion="mean").layer == ("0.0", "1.0")


@pytest.mark.parametrize("text", ["F1@\u0661", "F4@\u0661.\u0660", "F1@\u0663 gradcam"])
def test_non_ascii_digits_are_no_layer(text):
    with pytest.raises(vc.RecipeError, match="digits other than 0-9"):
        Recipe.parse(text)


def test_a_stage_block_of_non_ascii_digits_is_refused():
    with pytest.raises(vc.RecipeError, match="^layer: "):
        Recipe(layer="\u0661.\u0660")
