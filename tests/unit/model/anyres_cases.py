"""Tiny random LLaVA-NeXT and LLaVA-OneVision models built in code (no hub), their traces, and the hand-written
hook-and-autograd reference of every site, for ``test_vlm_llava_next*.py``.

NeXT: a 3-layer CLIP tower (width 32, 32 px tiles of 4x4 patches, class token, ``vision_feature_layer=-2``), a
2-layer Llama. OneVision: a 3-layer SigLIP tower (no class token, ``vision_feature_layer=-1``, strategy
``full``). The image is 60x70 px: the 64x64 pinpoint wins, 2x2 crops after the base view (5 crops), one row of
padding cells cut at the top and bottom (6x8 cells kept). ``pixel_values`` hold one padding row more (6), as the
processor pads a batch; the model runs the first 5."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from vlm_marks import answer_gradients

import vitcam_nb as vc

IMG, TILE, PATCH, SIDE = 63, 32, 8, 4
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
SIZE = (60, 70)
ANSWER = [9, 10, 11]
TOWER = ("F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid")
LM = ("projector", "lm_resid", "lm_attn")
#: image tokens: base 16, then 6 rows of 8 cells + 1 newline (NeXT and OneVision below anyres_max); resampled
#: OneVision (anyres_max_1) shrinks 6x8 to 3x4: 16 + 3 * 5
N_TOKENS = {"next": 16 + 6 * 9, "onevision": 16 + 6 * 9, "resampled": 16 + 3 * 5}


def make(kind: str, seed: int = 0) -> torch.nn.Module:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    if kind == "next":
        v = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                             image_size=TILE, patch_size=PATCH)
        cfg = LlavaNextConfig(vision_config=v, text_config=t, image_token_id=IMG, vision_feature_layer=-2,
                              image_grid_pinpoints=PINPOINTS)
        return LlavaNextForConditionalGeneration(cfg).eval()
    v = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           image_size=TILE, patch_size=PATCH)
    cfg = LlavaOnevisionConfig(vision_config=v, text_config=t, image_token_id=IMG, image_grid_pinpoints=PINPOINTS,
                               vision_aspect_ratio="anyres_max_1" if kind == "resampled" else "anyres_max_9")
    return LlavaOnevisionForConditionalGeneration(cfg).eval()


def prompt(kind: str) -> list[int]:
    return [1, 5, 6] + [IMG] * N_TOKENS[kind] + [7, 8]


def pixels(seed: int = 1, rows: int = 6) -> torch.Tensor:
    return torch.randn(1, rows, 3, TILE, TILE, generator=torch.Generator().manual_seed(seed))


def target(kind: str, **extra) -> object:
    return vc.targets.answer(input_ids=prompt(kind), answer_ids=ANSWER,
                             model_kwargs={"image_sizes": torch.tensor([SIZE]), **extra})


def _first(t):
    return t[0] if isinstance(t, (tuple, list)) else t


def reference(model: torch.nn.Module, kind: str, x: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
    """Activations and gradients of every site on an eager copy ((layer, site) keys; tower sites (crop, ...) with
    every crop the tower ran on; LM sites over the whole sequence) for the outputs the trace differentiates."""
    ref = copy.deepcopy(model)
    ref.model.language_model.config._attn_implementation = "eager"
    ref.model.vision_tower.config._attn_implementation = "eager"
    kept, handles = {}, []

    def out(key, index=None):
        return lambda _m, _i, o: kept.__setitem__(key, o[index] if index is not None else _first(o))

    def inp(key):
        return lambda _m, args: kept.__setitem__(key, args[0])

    for i, layer in enumerate(ref.model.vision_tower.encoder.layers):
        handles += [layer.layer_norm1.register_forward_hook(out((i, "F1"))),
                    layer.self_attn.register_forward_hook(out((i, "F2"), 1)),
                    layer.self_attn.out_proj.register_forward_pre_hook(inp((i, "F3"))),
                    layer.layer_norm2.register_forward_hook(out((i, "F4"))),
                    layer.mlp.register_forward_hook(out((i, "F5"))),
                    layer.register_forward_hook(out((i, "F6"))),
                    layer.register_forward_pre_hook(inp((i, "resid_pre"))),
                    layer.self_attn.register_forward_hook(out((i, "attn_out"), 0)),
                    layer.layer_norm2.register_forward_pre_hook(inp((i, "resid_mid")))]
    handles.append(ref.model.multi_modal_projector.register_forward_hook(out((0, "projector"))))
    for i, layer in enumerate(ref.model.language_model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda _m, args, kwargs, k=(i, "lm_resid"): kept.__setitem__(k, args[0] if args else
                                                                         kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(out((i, "lm_attn"), 1)))
    seq = torch.tensor([prompt(kind) + ANSWER])
    logits = ref(input_ids=seq, pixel_values=x.clone(), image_sizes=torch.tensor([SIZE]), use_cache=False).logits[0]
    for h in handles:
        h.remove()
    whole = tuple(k for k in kept if k[1] in (*TOWER, "projector"))
    return answer_gradients(logits, len(prompt(kind)), ANSWER, kept, whole)


@dataclass
class Case:
    kind: str
    model: torch.nn.Module
    x: torch.Tensor
    trace: object
    acts: dict
    grads: dict
    scores: torch.Tensor


def build(kind: str, sites: tuple[str, ...] = TOWER + LM) -> Case:
    model, x = make(kind), pixels()
    tr = vc.trace(model, x, targets=target(kind), sites=list(sites))
    acts, grads, scores = reference(model, kind, x)
    return Case(kind, model, x, tr, acts, grads, scores)


def tower_values(tr, site: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(crop, ...) activations and (crop, target, ...) gradients of a tower site at one layer."""
    if site == "F2":
        return tr["attn"].values[:, layer], tr["attn_grad"].values[:, :, layer]
    si = list(tr["site"].values).index(site)
    return tr["act"].values[:, layer, si], tr["grad"].values[:, :, layer, si]
