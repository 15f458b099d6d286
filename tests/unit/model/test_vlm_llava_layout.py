"""LLaVA's image-token layout checked through LLaVA's own merge path (the projector's rows marked, found again in
the LM's ``inputs_embeds``), for the default and the "full" feature strategies and split placeholder runs; and the
answer targets: prompt/answer text through a processor built in code, ``model.generate``'s output, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_vlm_llava import ANSWER, GRID, IMAGE_ID, PROMPT, make_llava, make_x

import vitcam_nb as vc
from vitcam_nb.adapters.hf_vlm import HfVlmAdapter

transformers = pytest.importorskip("transformers")


def landed(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """Run LLaVA with its projector's output replaced by the row index + 1 in channel 0 (0 elsewhere), and read
    channel 0 of the LM's ``inputs_embeds``: at each placeholder position, which projector row LLaVA put there."""
    seen = {}

    def mark(_m, _i, out):
        marked = torch.zeros_like(out)
        marked[..., 0] = torch.arange(1, out.shape[-2] + 1, dtype=out.dtype)
        return marked

    def grab(_m, _args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach()

    handles = [model.model.multi_modal_projector.register_forward_hook(mark),
               model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), pixel_values=make_x(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen["embeds"][0, :, 0].numpy()


@pytest.mark.parametrize("strategy", ["default", "full"])
@pytest.mark.parametrize("split", [False, True])
def test_layout_matches_where_llava_puts_each_tower_token(strategy, split):
    model = make_llava(strategy=strategy)
    n = GRID * GRID + (strategy == "full")
    image = [IMAGE_ID] * n
    ids = [1, 5] + (image[:7] + [6, 7] + image[7:] if split else image) + [8]  # split: two runs of placeholders
    values = landed(model, ids)
    lay = HfVlmAdapter().layout(model, np.array(ids))
    # every kept image token's position holds the projector row of the tower token at its cell: row-major over
    # the 4x4 patches, after the class token under "full" (row 1 is patch 0), from row 1 under "default"
    first_patch_row = 2 if strategy == "full" else 1
    expected_rows = first_patch_row + lay.rows * GRID + lay.cols
    np.testing.assert_array_equal(values[lay.positions], expected_rows)
    # and those are exactly the positions LLaVA filled (text positions hold the token embeddings, not a row)
    filled = np.flatnonzero(np.array(ids) == IMAGE_ID)
    kept = filled[1:] if strategy == "full" else filled
    np.testing.assert_array_equal(lay.positions, kept)
    assert sorted(zip(lay.rows.tolist(), lay.cols.tolist())) == [(r, c) for r in range(GRID) for c in range(GRID)]
    if strategy == "full":
        assert values[filled[0]] == 1 and dict(lay.dropped) == {"class token": 1}  # the class token, dropped
        assert "1 class token at position" in lay.description
    else:
        assert dict(lay.dropped) == {}


def test_full_strategy_trace_stores_patch_tokens_only():
    model = make_llava(strategy="full")
    prompt = [1, 5] + [IMAGE_ID] * (GRID * GRID + 1) + [6]
    tr = vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=prompt, answer_ids=[9]),
                  sites=["projector", "lm_resid"])
    np.testing.assert_array_equal(tr["image_token_pos"].values, np.arange(3, 3 + GRID * GRID))
    assert tr.sizes["image_token"] == GRID * GRID
    assert tr["projector"].attrs["layout_dropped"] == "class token:1"


def test_wrong_number_of_placeholders_is_refused_before_the_forward():
    model = make_llava()
    with pytest.raises(vc.TraceError, match=r"input_ids: 15 image placeholder tokens \(id 63\) but the 4x4 tower"):
        vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=PROMPT[:-3] + [5], answer_ids=ANSWER))


# --------------------------------------------------------------------------------------------------
# the answer targets


def make_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "USER:", "ASSISTANT:", "what", "colour", "is", "the", "square", "?", "red",
             "blue"]
    vocab = {w: i for i, w in enumerate(words)} | {"<image>": IMAGE_ID}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<image>"])
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                          image_token="<image>", num_additional_image_tokens=1)


def test_answer_from_prompt_text_and_processor():
    proc = make_processor()
    t = vc.targets.answer(prompt="USER: <image> what colour is the square ? ASSISTANT:", answer="red blue",
                          processor=proc)
    assert t.input_ids.tolist() == [3] + [IMAGE_ID] * 16 + [5, 6, 7, 8, 9, 10, 4]
    assert t.answer_ids.tolist() == [11, 12] and t.labels == ["red", "blue", "sequence log-prob", "logsumexp@red",
                                                "logsumexp@blue"]
    model = make_llava()
    rng = np.random.default_rng(0)
    tr = vc.trace(model, rng.integers(0, 256, (40, 40, 3), np.uint8), targets=t, sites=["F1", "lm_resid"],
                  processor=proc.image_processor)
    assert list(tr["class_label"].values) == ["red", "blue", "sequence log-prob", "logsumexp@red",
                                                "logsumexp@blue"]
    # the same ids given directly trace the same scores
    direct = vc.targets.answer(input_ids=t.input_ids, answer_ids=[11, 12], tokenizer=proc.tokenizer)
    tr2 = vc.trace(model, rng.integers(0, 256, (40, 40, 3), np.uint8), targets=direct, sites=["F1"],
                   processor=proc.image_processor)
    assert list(tr2["class_label"].values) == ["red", "blue", "sequence log-prob", "logsumexp@red",
                                                "logsumexp@blue"]


def test_generated_explains_what_generate_produced():
    model = make_llava()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=make_x(), attention_mask=torch.ones_like(ids),
                             max_new_tokens=3, do_sample=False)
    new = out[0, len(PROMPT):].tolist()
    t = vc.targets.generated(out, PROMPT)
    assert t.answer_ids.tolist() == new
    tr = vc.trace(model, make_x(), targets=t, sites=["lm_resid"])
    # greedy decoding: each generated token is the arg max at its predicting position, so its logit is the
    # largest of the vocabulary there; the traced scores are those logits (teacher forcing reproduces them)
    with torch.no_grad():
        logits = model(input_ids=out, pixel_values=make_x(), use_cache=False).logits[0]
    rows = np.arange(len(PROMPT), len(PROMPT) + len(new)) - 1
    np.testing.assert_allclose(tr["logits"].values[:len(new)], logits[rows].max(-1).values.numpy(),
                               rtol=1e-5, atol=1e-5)
    # trailing stop tokens are left out; a sequence that is not the prompt's continuation is refused
    assert vc.targets.generated(out[0].tolist() + [2, 2], PROMPT, stop_ids=[2]).answer_ids.tolist() == new
    with pytest.raises(vc.ArgumentError, match="sequences: does not start with input_ids"):
        vc.targets.generated([5, 5, 5], PROMPT)


def test_answer_argument_refusals():
    with pytest.raises(vc.ArgumentError, match="input_ids: give input_ids and answer_ids"):
        vc.targets.answer(input_ids=PROMPT)
    with pytest.raises(vc.ArgumentError, match="prompt: give either"):
        vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER, prompt="x", answer="y")
    with pytest.raises(vc.ArgumentError, match="processor: prompt/answer text needs"):
        vc.targets.answer(prompt="x", answer="y")
    with pytest.raises(vc.TraceError, match="answer_ids: expected integer token ids"):
        vc.targets.answer(input_ids=PROMPT, answer_ids=[1.5])
    model = make_llava()
    with pytest.raises(vc.TraceError, match="answer_ids: holds the image placeholder token"):
        vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=[IMAGE_ID]))
    with pytest.raises(vc.TraceError, match=r"input_ids: token ids must lie in 0\.\.63"):
        vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=[64]))


def test_model_kwargs_reach_the_forward_and_the_trace_id():
    model = make_llava()
    plain = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    # vision_feature_layer=-1 makes LLaVA read the last tower layer: its sites get gradients, the scores change
    last = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER, model_kwargs={"vision_feature_layer": -1})
    a = vc.trace(model, make_x(), targets=plain, sites=["F1"])
    b = vc.trace(model, make_x(), targets=last, sites=["F1"])
    assert a.attrs["trace_id"] != b.attrs["trace_id"]
    assert not np.any(a["grad"].values[:, 2]) and np.any(b["grad"].values[:, 2])
    assert "tower layers the LM never reads" in a.attrs["target_checklist"]
    assert "tower layers the LM never reads" not in b.attrs["target_checklist"]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT + ANSWER]), pixel_values=make_x(), vision_feature_layer=-1,
                    use_cache=False).logits[0, len(PROMPT) - 1, ANSWER[0]]
    np.testing.assert_allclose(b["logits"].values[0], float(ref), rtol=1e-5)
    with pytest.raises(vc.ArgumentTypeError, match="model_kwargs: expected a dict"):
        vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER, model_kwargs=[1])


def test_checklist_names_the_tower_layers_the_lm_never_reads():
    import json

    model = make_llava()
    tr = vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), sites=["F1"])
    with pytest.warns(vc.DegenerateMapWarning):
        m = vc.cam(tr, vc.Recipe(site="F1", layer=-1))
    item = json.loads(m.attrs["checklist"])["gradient target"]["tower layers the LM never reads"]
    assert item.startswith("2 (above the vision_feature_layer")
