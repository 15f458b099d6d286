"""Qwen2-VL / Qwen2.5-VL input: the tower token -> image cell map against the family's own code (each patch of
the image marked with its own constant, through the real image processor and the tower's own patch embedding and
window permutation), the trace's image rebuilt from the patches, bad input refused by name before the model runs,
and ``vc.targets.answer(prompt=..., processor=...)`` with a Qwen2-VL processor built in code."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vlm_qwen_tiny import ANSWER, IMG, PROMPT, SIZE, make_inputs, make_model  # noqa: E402

import vitcam_nb as vc  # noqa: E402

GH, GW, P = SIZE[0] // 14, SIZE[1] // 14, 14


def answer(thw, **kw):
    return vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER, model_kwargs={"image_grid_thw": thw, **kw})


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5"])
def test_tower_tokens_land_on_the_cell_they_cover(kind):
    """Patch (r, c) of the image holds the constant v = r * GW + c + 1 in every pixel and channel; the processor
    packs it (merge-block order), the tower's patch embedding (a bias-free Conv3d) makes it v * u, Qwen2.5-VL
    permutes it into window order; the stored token at (patch_row, patch_col) must be that cell's v * u."""
    from transformers import Qwen2VLImageProcessor

    model = make_model(kind)
    v = (np.arange(GH)[:, None] * GW + np.arange(GW)[None] + 1).astype(np.float32)
    img = np.repeat(np.repeat(v, P, 0), P, 1)[None].repeat(3, 0)  # (3, H, W) channels first
    out = Qwen2VLImageProcessor(do_resize=False, do_rescale=False, do_normalize=False)(
        images=[torch.from_numpy(img)], return_tensors="pt")
    tr = vc.trace(model, out["pixel_values"], targets=answer(out["image_grid_thw"]), sites=["resid_pre"], layers=[0])
    u = model.model.visual.patch_embed.proj.weight.detach().sum((1, 2, 3, 4)).numpy()
    tokens = tr["act"].values[0, 0]  # (token, channel), the patch embedding's output
    got = tokens @ u / (u @ u)
    np.testing.assert_allclose(tokens, got[:, None] * u[None], rtol=1e-4, atol=1e-4)  # each token is v * u
    expected = v[tr["patch_row"].values, tr["patch_col"].values]
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert tr["token_kind"].values.tolist() == ["patch"] * GH * GW and "raster" in tr.attrs["token_order"]


def test_rebuilt_image_undoes_the_given_processor_normalisation():
    from transformers import Qwen2VLImageProcessor

    img = np.random.default_rng(3).integers(0, 256, (*SIZE, 3), dtype=np.uint8)
    proc = Qwen2VLImageProcessor(do_resize=False, image_mean=[0.2, 0.3, 0.4], image_std=[0.5, 0.6, 0.7])
    out = proc(images=[img], return_tensors="pt")
    tr = vc.trace(make_model("qwen2"), out["pixel_values"], targets=answer(out["image_grid_thw"]), sites=["F1"],
                  layers=[-1], processor=proc)
    np.testing.assert_array_equal(tr["image"].values, img)
    assert "given processor" in tr.attrs["preprocessing"]
    # without the processor the default (OpenAI CLIP) statistics are undone instead: another image, said so
    tr2 = vc.trace(make_model("qwen2"), out["pixel_values"], targets=answer(out["image_grid_thw"]), sites=["F1"],
                   layers=[-1])
    assert not np.array_equal(tr2["image"].values, img) and "default normalisation" in tr2.attrs["preprocessing"]


# --------------------------------------------------------------------------------------------------
# bad input refused by name before the model runs


@pytest.fixture(scope="module")
def counted():
    model = make_model("qwen2_5")
    calls = []
    model.register_forward_pre_hook(lambda *_a: calls.append(1))
    return model, calls


def refused(counted, image, target, match, exc=vc.VitcamError, **kw):
    model, calls = counted
    before = len(calls)
    with pytest.raises(exc, match=match):
        vc.trace(model, image, targets=target, sites=["F1", "lm_resid"], **kw)
    assert len(calls) == before, "the model ran before the refusal"


def test_bad_inputs_are_refused_by_name(counted):
    pv, thw, img = make_inputs()
    refused(counted, pv, vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), r"model_kwargs: .*image_grid_thw")
    refused(counted, pv, answer(torch.tensor([[1, 6, 10], [1, 6, 10]])), r"model_kwargs: .*2 images")
    refused(counted, pv, answer(torch.tensor([[2, 6, 10]])), r"model_kwargs: .*t=1")
    refused(counted, pv, answer(torch.tensor([[1, 4, 10]])), r"input_ids: 15 image tokens .* packs 10")
    refused(counted, pv[:-4], answer(torch.tensor([[1, 6, 10]])), r"image: 56 patches but image_grid_thw")
    refused(counted, pv[:, :-1], answer(thw), r"image: expected pixel_values of shape \(N_patches, 1176\)")
    refused(counted, img, answer(thw), r"image: Qwen2-VL takes its processor's pixel_values", vc.ArgumentTypeError)
    video = pv.clone().reshape(60, 3, 2, 196)
    video[:, :, 1] += 1.0
    refused(counted, video.reshape(60, -1), answer(thw), r"image: the 2 temporal copies of a patch differ")
    refused(counted, pv, answer(thw, mm_token_type_ids=torch.zeros(1, len(PROMPT))),
            r"model_kwargs: mm_token_type_ids covers 21 tokens but the prompt with its answer has 24")
    refused(counted, pv, answer(thw), r"processor: expected the model's processor", processor=object())
    refused(counted, pv, "top1", r"targets: 'top1' ranks a classifier's logits, but Qwen2_5_VLForConditionalGeneration")


def test_the_packed_input_needs_the_answer_target():
    from vitcam_nb.adapters import find_adapter

    model = make_model("qwen2")
    pv, _thw, _img = make_inputs()
    with pytest.raises(vc.TraceError, match="image: Qwen2-VL's pixel_values are read with the answer target"):
        find_adapter(model).prepare_input(model, pv)


# --------------------------------------------------------------------------------------------------
# answer(prompt=..., processor=...) with a Qwen2-VL processor


def tiny_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "what": 3, "is": 4, "<|image_pad|>": IMG, "<|video_pad|>": 6,
             "<|vision_start|>": 7, "<|vision_end|>": 8, "colour": 9, "red": 10, "blue": 11, "green": 12}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=[
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=fast,
                            video_processor=Qwen2VLVideoProcessor())


def test_answer_from_prompt_text_with_the_qwen_processor():
    proc = tiny_processor()
    img = np.random.default_rng(4).integers(0, 256, (*SIZE, 3), dtype=np.uint8)
    prompt = "what colour <|vision_start|><|image_pad|><|vision_end|> is"
    inputs = proc(images=[img], text=prompt, return_tensors="pt")
    with pytest.raises(vc.ArgumentError, match=r"model_kwargs: this processor expands the image placeholder"):
        vc.targets.answer(prompt=prompt, answer="red", processor=proc)
    target = vc.targets.answer(prompt=prompt, answer="red blue", processor=proc,
                               model_kwargs={"image_grid_thw": inputs["image_grid_thw"]})
    # the same ids as the processor gives for the real image (the placeholder expanded by its grid)
    assert target.input_ids.tolist() == inputs["input_ids"][0].tolist()
    assert target.answer_ids.tolist() == [10, 11] and target.tokens == ["red", "blue"]
    tr = vc.trace(make_model("qwen2"), inputs["pixel_values"], targets=target, sites=["lm_resid"], processor=proc)
    assert list(tr["class_label"].values[:2]) == ["red", "blue"]
    np.testing.assert_array_equal(tr["image"].values, img)
    with pytest.raises(vc.ArgumentError, match=r"model_kwargs: image_grid_thw \[\[1, 6, 11\]\] is not what"):
        vc.targets.answer(prompt=prompt, answer="red", processor=proc, model_kwargs={"image_grid_thw": [[1, 6, 11]]})
