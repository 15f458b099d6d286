"""The detection target (issue #37): which detection a box matches (IoU, on hand-made boxes), the score it
differentiates (logit, or the probability the model's post-processing reports), what the checklist states, a
Grad-CAM of one detection against a NumPy formula, and the refusals, each naming its argument.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close, assert_unchanged, snapshot

import vitcam_nb as vc
from vitcam_nb.targets.detection import box_iou

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

from unit.model.test_owl import TEXTS, HandTokenizer, build_owl, owl_input, owl_logits, owl_run  # noqa: E402
from unit.model.test_yolos import N_DET, build_yolos, redraw, yolos_input, yolos_run  # noqa: E402

#: Five hand-made predicted boxes (x0, y0, x1, y1) in pixels of a 32x32 input. Against the box (0, 0, 16, 16):
#: IoU 64/256 = 0.25, 0, 144/368 = 0.391, 192/256 = 0.75, 256/1024 = 0.25, so detection 3 matches; against
#: (16, 16, 32, 32) detection 1 matches with IoU 1.
HAND = np.array([[0, 0, 8, 8], [16, 16, 32, 32], [4, 4, 20, 20], [0, 0, 16, 12], [0, 0, 32, 32]], np.float64)


class HandBoxes(transformers.YolosForObjectDetection):
    """YOLOS whose box head is replaced by the hand-made boxes (its class logits are the model's own)."""

    def forward(self, pixel_values, **kwargs):
        out = super().forward(pixel_values, **kwargs)
        x0, y0, x1, y1 = torch.from_numpy(HAND / 32.0).float().unbind(-1)
        out.pred_boxes = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], -1)[None]
        return out


def hand_model() -> HandBoxes:
    cfg = build_yolos().config
    torch.manual_seed(0)
    return redraw(HandBoxes(cfg))


def test_box_iou_is_the_textbook_formula():
    got = box_iou((0, 0, 16, 16), HAND)
    np.testing.assert_allclose(got, [0.25, 0.0, 144 / 368, 0.75, 0.25], rtol=1e-12)


def test_boxes_are_matched_by_highest_iou_and_the_checklist_states_it():
    model, x = hand_model(), yolos_input()
    before = snapshot(model)
    tr = vc.trace(model, x, targets=vc.targets.detection(box=[(0, 0, 16, 16), (16, 16, 32, 32)], class_=1),
                  sites=["F1"], layers=[-1])
    assert_unchanged(before, model)
    with torch.no_grad():
        logits = model(pixel_values=x).logits[0].double().numpy()
    assert_rel_close(tr["logits"].values, logits[[3, 1], 1], "logits of the matched detections 3 and 1")
    found = json.loads(tr.attrs["target_detections"])
    assert [d["detection"] for d in found] == [3, 1] and found[0]["box"] == [0, 0, 16, 12]
    assert list(tr["class_label"].values) == ["detection 3: LABEL_1", "detection 1: LABEL_1"]
    items = json.loads(vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=0)).attrs["checklist"])["gradient target"]
    assert items["score 0"].startswith("detection 3, detection token 3 of 5 (trace token 4, kind det); matched to "
                                       "the given box (0, 0, 16, 16) by IoU 0.7500 (the highest of 5 predicted")
    assert "predicted box (0, 0, 16, 12) px; class 1 'LABEL_1' (given)" in items["score 0"]
    assert f"logit {logits[3, 1]:.6g}" in items["score 0"]
    assert "by IoU 1.0000" in items["score 1"] and items["matched by"].startswith("IoU of each given box")
    assert items["detection score"].startswith("the class logit of the detection token's class head")


def test_default_class_is_the_top_class_without_no_object_and_prob_is_the_post_processing_softmax():
    model, x = build_yolos(), yolos_input()
    with torch.no_grad():
        logits = model(pixel_values=x).logits[0]
    top = int(torch.argmax(logits[2, :-1]))
    prob = float(torch.softmax(logits[2], dim=0)[top])  # YolosImageProcessor: softmax over classes + no-object
    tr = vc.trace(model, x, targets=vc.targets.detection(query=2, score="prob"), sites=["F1"], layers=[-1])
    assert_rel_close(tr["logits"].values, [prob], "probability of the top class")
    assert json.loads(tr.attrs["target_detections"])[0]["class"] == top
    assert "highest logit, no-object excluded" in tr.attrs["target_checklist"]
    _, g = _last_f1(model, x, lambda m, xx: torch.softmax(m(pixel_values=xx).logits[0, 2], dim=0)[top],
                    "vit.encoder.layer", "layernorm_before")
    stored = tr["grad"].sel(site="F1", target=str(tr["target"].values[0])).values[0]
    assert_rel_close(stored[1 + N_DET:], g[1:17], "gradient of the probability at the patch tokens")


def test_owl_prob_is_the_sigmoid_of_the_text_query_logit():
    model, x = build_owl("hf_owlv2"), owl_input()
    target = vc.targets.detection(query=7, text=TEXTS, class_=2, score="prob", tokenizer=HandTokenizer())
    tr = vc.trace(model, x, targets=target, sites=["F6"], layers=[-1])
    with torch.no_grad():
        want = torch.sigmoid(owl_logits(model, x)[7, 2]).double().numpy()
    assert_rel_close(tr["logits"].values, [want], "sigmoid of the logit")
    assert list(tr["class_label"].values) == ["detection 7: an owl"]


def _last_f1(model, x, score, layers: str, norm: str):
    """(F1 activation, gradient of ``score``) of the last layer, from my own hook on an eager copy."""
    m = copy.deepcopy(model).eval()
    m.set_attn_implementation("eager")
    seen = {}
    m.get_submodule(layers)[-1].get_submodule(norm).register_forward_hook(lambda _m, _i, out: seen.update(a=out))
    with torch.enable_grad():
        (g,) = torch.autograd.grad(score(m, x), seen["a"])
    return seen["a"][0].detach().double().numpy(), g[0].double().numpy()


@pytest.mark.parametrize("family", ["hf_yolos", "hf_owlvit"])
def test_gradcam_of_one_detection_equals_the_numpy_formula(family):
    """Grad-CAM at F1 of the last block for score 0 (detection 1 of YOLOS, patch 5 of OWL-ViT):
    relu(sum_c mean_t(dS/dA[t, c]) A[:, c]) over the patch tokens, reshaped to the 4x4 grid."""
    if family == "hf_yolos":
        model, x, tr, _, _ = yolos_run()
        a, g = _last_f1(model, x, lambda m, xx: m(pixel_values=xx).logits[0, 1, 2], "vit.encoder.layer",
                        "layernorm_before")
        patches = slice(1, 1 + 16)  # the model's sequence: class token, 16 patches, then the detection tokens
    else:
        model, x, tr, _, _ = owl_run(family)
        a, g = _last_f1(model, x, lambda m, xx: owl_logits(m, xx)[5, 1], "owlvit.vision_model.encoder.layers",
                        "layer_norm1")
        patches = slice(1, 17)
    a, g = a[patches], g[patches]
    want = np.maximum(a @ g.mean(axis=0), 0).reshape(4, 4)
    got = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=0, weighting="gradcam", weight_tokens="patch",
                               upsample="none", normalize="none"))
    assert got.shape == (4, 4) and want.max() > 0
    np.testing.assert_allclose(got.values, want, rtol=1e-5, atol=1e-6 * want.max())


def test_bad_input_is_refused_naming_the_argument_and_the_model_is_left_alone():
    model, x = build_yolos(), yolos_input()
    before = snapshot(model)
    det = vc.targets.detection
    with pytest.raises(vc.TraceError, match=r"box: \(0.0, 0.0, 40.0, 16.0\) lies outside the 32x32 model input"):
        vc.trace(model, x, targets=det(box=(0, 0, 40, 16)), sites=["F1"])
    with pytest.raises(vc.TraceError, match=r"box: \(-1, 0, 8, 8\) lies outside the image"):
        det(box=(-1, 0, 8, 8))
    with pytest.raises(vc.TraceError, match="box: .* is empty"):
        det(box=(8, 0, 8, 8))
    with pytest.raises(vc.TraceError, match=f"query: 5 is out of range; the model makes {N_DET} detections"):
        vc.trace(model, x, targets=det(query=[0, 5]), sites=["F1"])
    with pytest.raises(vc.TraceError, match="text: YolosForObjectDetection has fixed classes"):
        vc.trace(model, x, targets=det(query=0, text="a cat", tokenizer=HandTokenizer()), sites=["F1"])
    with pytest.raises(vc.TraceError, match="class_: 3 is out of range; the model has 3 classes"):
        vc.trace(model, x, targets=det(query=0, class_=3), sites=["F1"])
    with pytest.raises(vc.TraceError, match="box: give box=.* or query=i"):
        det(box=(0, 0, 8, 8), query=1)
    with pytest.raises(vc.TraceError, match=r"score: expected one of \['logit', 'prob'\]"):
        det(query=0, score="logprob")
    with pytest.raises(vc.TraceError, match="match: expected one of"):
        det(box=(0, 0, 8, 8), match="center")
    with pytest.raises(TypeError, match="tokenizer: text queries need a Hugging Face tokenizer"):
        det(query=0, text=["a cat"])
    with pytest.raises(vc.TraceError, match="class_: 3 is out of range for 3 text queries"):
        det(query=0, text=TEXTS, class_=3, tokenizer=HandTokenizer())
    assert_unchanged(before, model)
    owl = build_owl("hf_owlvit")
    with pytest.raises(vc.TraceError, match="text: OwlViTForObjectDetection scores text or image queries"):
        vc.trace(owl, owl_input(), targets=det(query=0), sites=["F1"])
    with pytest.raises(vc.TraceError, match="query: 16 is out of range; the model makes 16 detections"):
        vc.trace(owl, owl_input(), targets=det(query=16, text=TEXTS, tokenizer=HandTokenizer()), sites=["F1"])
    with pytest.raises(vc.TraceError, match="model: a detection target reads YolosForObjectDetection"):
        vc.trace(transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64)), x, targets=det(query=0), sites=["F1"])


@pytest.mark.parametrize("family", ["hf_yolos", "hf_owlv2"])
def test_fixed_detections_score_a_batch_as_the_model_does_and_vc_score_takes_them(family):
    """query + class_ decide nothing per image, so vc.score's perturbed batches are scored; box matching is not."""
    xs = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    if family == "hf_yolos":
        model = build_yolos()
        target = vc.targets.detection(query=[0, 4], class_=1, score="prob")
        with torch.no_grad():
            want = torch.softmax(model(pixel_values=xs).logits[:, [0, 4]], dim=-1)[..., 1]
    else:
        model = build_owl(family)
        target = vc.targets.detection(query=[3, 9], text=TEXTS, class_=0, tokenizer=HandTokenizer())
        with torch.no_grad():
            want = torch.stack([owl_logits(model, xs[i:i + 1])[[3, 9], 0] for i in range(3)])
    with torch.no_grad():
        got = target.batch_scores(model, xs)
    assert_rel_close(got.numpy(), want.numpy(), "batched detection scores")
    tr = vc.trace(model, xs[:1], targets=target, sites=["F1"], layers=[-1])
    if family == "hf_yolos":  # its detection tokens are moved in the trace: vc.score zeroes sites in model order
        with pytest.raises(vc.TraceError, match="the hf_yolos adapter rearranges its sites"):
            vc.score(tr, model, "scorecam", xs[:1], targets=target, layer=-1, progress=False)
    else:
        scored = vc.score(tr, model, "scorecam", xs[:1], targets=target, layer=-1, progress=False)
        assert np.isfinite(scored["score"].values).all() and scored["score"].sizes["channel"] == 32
    with pytest.raises(vc.TraceError, match="box: matching a box or choosing the top class is done per image"):
        vc.targets.detection(box=(0, 0, 8, 8), class_=0).batch_scores(build_yolos(), xs)
