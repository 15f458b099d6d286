"""Issue #37 follow-ups on detectors: ``single_head_attention`` runs a YOLOS block as one head (as a one-head YOLOS
with the same weights computes it) or refuses an attention it cannot change, naming it, before any block changes;
a class target on a detector names the detection target to use instead; the detection known-answer report leaves
a file it did not write alone."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from vitcam_testing import assert_rel_close, assert_unchanged, snapshot

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

from unit.model.test_yolos import build_yolos, yolos_input  # noqa: E402


def test_single_head_attention_runs_a_yolos_block_as_a_one_head_yolos_with_the_same_weights():
    model, x = build_yolos(), yolos_input()  # two heads of width 16
    one_head = transformers.YolosForObjectDetection(transformers.YolosConfig(**{
        **model.config.to_dict(), "num_attention_heads": 1})).eval()
    one_head.load_state_dict(model.state_dict())  # q, k, v are (32, 32) either way: only the head split differs
    with torch.no_grad():
        plain = model(pixel_values=x).logits
        expected = one_head(pixel_values=x).logits
        with vc.adapters.single_head_attention(model, layers=(0, 1)):
            got = model(pixel_values=x).logits
            attn = model.vit.encoder.layer[1].attention.attention
            assert (attn.num_attention_heads, attn.attention_head_size, attn.scaling) == (1, 32, 32 ** -0.5)
        after = model(pixel_values=x).logits
    assert_rel_close(got.numpy(), expected.numpy(), "one-head logits")
    assert not torch.allclose(plain, expected)  # the head split matters for these weights
    assert torch.equal(after, plain)
    attn = model.vit.encoder.layer[1].attention.attention
    assert (attn.num_attention_heads, attn.attention_head_size, attn.scaling) == (2, 16, 16 ** -0.5)


def test_single_head_attention_refuses_an_attention_without_head_attributes_before_changing_any_block():
    model = build_yolos()
    del model.vit.encoder.layer[1].attention.attention.num_attention_heads
    first = model.vit.encoder.layer[0].attention.attention
    with pytest.raises(TypeError, match=r"^model: .*YolosSelfAttention has neither attribute pair"):
        with vc.adapters.single_head_attention(model, layers=(0, 1)):
            pass
    assert (first.num_attention_heads, first.attention_head_size) == (2, 16)


def test_a_class_target_on_a_detector_names_the_detection_target():
    model, x = build_yolos(), yolos_input()
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match=r"^model: YolosForObjectDetection is a detector .*"
                                            r"vitcam_nb\.targets\.detection\(box="):
        vc.trace(model, x, targets="top1")
    assert_unchanged(before, model)


def test_the_detection_report_leaves_a_file_it_did_not_write_alone_before_tracing(tmp_path, monkeypatch):
    """The old report wrote ``known_answer_detection.csv`` over whatever was there; now the folder check refuses
    first, and a folder it wrote itself is rewritten."""
    model = build_yolos(image_size=[64, 64])
    mine = tmp_path / "known_answer_detection.csv"
    mine.write_text("a user's table\n")
    traced = []
    monkeypatch.setattr("vitcam_nb.evaluate.report.known_answer_detection.trace",
                        lambda *a, **k: traced.append(1) or vc.trace(*a, **k))
    with pytest.raises(vc.OutputExistsError, match="known_answer_detection.csv exists and is not a file vitcam_nb"):
        vc.evaluate.report_known_answer_detection(model, n_images=1, out_dir=tmp_path)
    assert mine.read_text() == "a user's table\n" and traced == []
    out = tmp_path / "fresh"
    table, summary = vc.evaluate.report_known_answer_detection(model, n_images=1, out_dir=out)
    again, _ = vc.evaluate.report_known_answer_detection(model, n_images=1, out_dir=out)  # its own files: rewritten
    assert json.loads((out / "known_answer_detection.json").read_text())["summary"] == summary
    pd.testing.assert_frame_equal(pd.read_csv(out / "known_answer_detection.csv"), again, check_dtype=False)
