"""The adapter for Hugging Face ``BlipForImageTextRetrieval`` (BLIP image-text matching, ``vitcam_nb[vlm]``).

Vision side: the sites F1..F6 (and the extended ones) of every layer of ``vision_model.encoder.layers``, laid
out as for a timm ViT (class embedding first, then the patches in raster order). Text side: the extra site
``xattn``, the cross-attention probabilities of every text-encoder layer, text tokens as queries over the
vision tokens (CLS + patches) as keys. :mod:`vitcam_nb.compute.xattn` turns them into heatmaps; the
image-text matching target is :func:`vitcam_nb.targets.itm`.

transformers is never imported here at module level: the adapter recognises the model by its class name
and module, so ``import vitcam_nb`` stays light.

Example:
    >>> import vitcam_nb as vc
    >>> from transformers import BlipForImageTextRetrieval, BlipProcessor  # doctest: +SKIP
    >>> model = BlipForImageTextRetrieval.from_pretrained("Salesforce/blip-itm-base-coco").eval()  # doctest: +SKIP
    >>> proc = BlipProcessor.from_pretrained("Salesforce/blip-itm-base-coco")  # doctest: +SKIP
    >>> ids = proc.tokenizer("a dog on a sofa", return_tensors="pt").input_ids  # doctest: +SKIP
    >>> tr = vc.trace(model, image, targets=vc.targets.itm(ids, tokenizer=proc.tokenizer))  # doctest: +SKIP
    >>> vc.cam(tr, vc.Recipe(site="xattn", layer=-1, text_tokens="dog"))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from vitcam_nb.adapters.base import Adapter, SiteSpec
from vitcam_nb.adapters.hf import eager_attention
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import TraceError

__all__ = ["BLIP_SITES", "BlipAdapter", "MODEL_CLASS", "XATTN_TEMPLATE", "is_blip_itm"]

MODEL_CLASS = "BlipForImageTextRetrieval"
# BLIP's image processor normalises with the OpenAI CLIP statistics (transformers' OPENAI_CLIP_MEAN/STD).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
XATTN_MODULE = "crossattention.self.dropout"
XATTN_TEMPLATE = "text_encoder.encoder.layer.{layer}." + XATTN_MODULE

BLIP_SITES: dict[str, SiteSpec] = {
    "F1": SiteSpec("layer_norm1", "output", "LayerNorm output before multi-head attention"),
    "F2": SiteSpec("self_attn.dropout", "output", "softmax attention matrix per head"),
    "F3": SiteSpec("self_attn.projection", "input",
                   "attention output, heads concatenated, before the output projection"),
    "F4": SiteSpec("layer_norm2", "output", "LayerNorm output before the MLP"),
    "F5": SiteSpec("mlp", "output", "MLP output"),
    "F6": SiteSpec("", "output", "residual stream after the MLP (block output)"),
    "resid_pre": SiteSpec("", "input", "residual stream entering the block"),
    "attn_out": SiteSpec("self_attn", "output", "attention module output after the projection"),
    "resid_mid": SiteSpec("layer_norm2", "input", "residual stream after the attention residual"),
}


def is_blip_itm(model: object) -> bool:
    """Whether ``model`` is (a subclass of) transformers' ``BlipForImageTextRetrieval``, without importing
    transformers.

    Example:
        >>> is_blip_itm(object())
        False
    """
    return any(cls.__name__ == MODEL_CLASS and cls.__module__.startswith("transformers")
               for cls in type(model).__mro__)


@declare_family(needs="transformers", priority=150)
class BlipAdapter(Adapter):
    """Hugging Face ``BlipForImageTextRetrieval``: vision sites on ``vision_model.encoder.layers``, the
    cross-attention site ``xattn`` on the text encoder.

    Example:
        >>> import transformers  # doctest: +SKIP
        >>> BlipAdapter().prefix_kinds(model)  # doctest: +SKIP
        ['cls']
    """

    family = "blip"
    block_template = "vision_model.encoder.layers.{layer}"
    sites = BLIP_SITES

    def matches(self, model: torch.nn.Module) -> bool:
        return is_blip_itm(model)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(model.vision_model.encoder.layers)

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # BlipVisionEmbeddings prepends exactly one class embedding to the patch embeddings.
        return ["cls"]

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.vision_model.embeddings.patch_embedding

    def expected_grid(self, model: torch.nn.Module) -> tuple[int, int]:
        """The patch grid of the model's configured input size (BLIP's position embeddings are fixed to it).

        Example:
            >>> BlipAdapter().expected_grid(model)  # doctest: +SKIP
            (24, 24)
        """
        cfg = model.config.vision_config
        n = int(cfg.image_size) // int(cfg.patch_size)
        return n, n

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        got = (int(output.shape[-2]), int(output.shape[-1]))
        expected = self.expected_grid(model)
        if got != expected:
            # The ITM forward does not interpolate position embeddings: a smaller image would silently use
            # the first position embeddings only, so any other size is refused.
            size, patch = int(model.config.vision_config.image_size), int(model.config.vision_config.patch_size)
            raise TraceError(f"image: the model expects {size}x{size} input, got "
                             f"{got[0] * patch}x{got[1] * patch}; pass a PIL image or uint8 array to have it "
                             "resized")
        return got

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        # BLIP's attention is always an explicit softmax; there is no fused_attn flag to switch off.
        return [layer.self_attn for layer in model.vision_model.encoder.layers]

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        vcfg, tcfg = model.config.vision_config, model.config.text_config
        xattn = self.extra_sites(model).get("xattn", [])
        return {
            "num_heads": int(vcfg.num_attention_heads),
            "head_dim": int(vcfg.hidden_size) // int(vcfg.num_attention_heads),
            "embed_dim": int(vcfg.hidden_size),
            "global_pool": "none (the ITM head reads the text [CLS] token, which cross-attends to all vision "
                           "tokens)",
            "patch_size": int(vcfg.patch_size),
            "dynamic_img_size": 0,
            "hf_name_or_path": str(getattr(model.config, "_name_or_path", "") or ""),
            "text_num_layers": int(tcfg.num_hidden_layers),
            "text_num_heads": int(tcfg.num_attention_heads),
            "xattn_num_layers": len(xattn),
        }

    @contextlib.contextmanager
    def patched(self, model: torch.nn.Module) -> Iterator[None]:
        """Force the eager attention implementation for the trace (the text encoder's attention masks and any
        dispatching attention follow it), restoring every config afterwards, also on error."""
        with eager_attention(model):
            yield

    def data_config(self, model: torch.nn.Module) -> dict:
        """BLIP's image processor as a timm data config: resize (squash) to ``image_size`` bicubic, OpenAI
        CLIP mean/std, no crop.

        Example:
            >>> BlipAdapter().data_config(model)["input_size"]  # doctest: +SKIP
            (3, 384, 384)
        """
        size = int(model.config.vision_config.image_size)
        return {"input_size": (3, size, size), "mean": OPENAI_CLIP_MEAN, "std": OPENAI_CLIP_STD,
                "interpolation": "bicubic", "crop_pct": 1.0, "crop_mode": "squash"}

    def extra_sites(self, model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
        layers = list(model.text_encoder.encoder.layer)
        # A text encoder built without is_decoder has no cross-attention: then "xattn" does not exist.
        if not layers or not all(hasattr(layer, "crossattention") for layer in layers):
            return {}
        return {"xattn": [(layer.get_submodule(XATTN_MODULE), "output") for layer in layers]}

    def assemble_extra(self, model: torch.nn.Module, site: str, acts: list[np.ndarray], grads: list[np.ndarray],
                       target: object) -> tuple[dict, dict]:
        if site != "xattn":
            raise TraceError(f"sites: the blip adapter has no extra site {site!r}")
        attn = np.stack([a[0] for a in acts])  # (xattn_layer, head, text_token, key)
        # Batched gradients keep the batch axis of one behind the target axis: drop it.
        attn_grad = np.stack([g.reshape(g.shape[0], *a.shape[1:]) for g, a in zip(grads, acts)], axis=1)
        n_layers, n_heads, n_text, n_keys = attn.shape
        gh, gw = self.expected_grid(model)
        if n_keys != 1 + gh * gw:
            raise TraceError(f"model: the cross-attention has {n_keys} image keys but the {gh}x{gw} patch grid "
                             f"with one class token gives {1 + gh * gw}")
        # A target that names its text (tokens and attention_mask, as vitcam_nb.targets.itm does) labels the rows.
        tokens, attention = getattr(target, "tokens", None), getattr(target, "attention_mask", None)
        if tokens is not None and attention is not None and len(tokens) == n_text:
            strings, mask = list(tokens), np.asarray(attention, dtype=np.int64)
        else:  # a custom target: the text is unknown to us, only its length is
            strings, mask = [f"[token {i}]" for i in range(n_text)], np.ones(n_text, np.int64)
        # The vision and text towers may have different head counts (BLIP-large: 16 vs 12); a shared "head"
        # dimension would then clash with F2's, so only in that case the cross-attention heads get their own.
        head_dim = "head" if n_heads == int(model.config.vision_config.num_attention_heads) else "xattn_head"
        kinds = np.array(self.prefix_kinds(model) + ["patch"] * (gh * gw))
        rows = np.concatenate([[-1], np.repeat(np.arange(gh), gw)]).astype(np.int64)
        cols = np.concatenate([[-1], np.tile(np.arange(gw), gh)]).astype(np.int64)
        var_attrs = {"hook": XATTN_TEMPLATE + ":output",
                     "meaning": "cross-attention probabilities (after softmax and dropout) of text queries over "
                                "the vision tokens (CLS + patches) fed to the text encoder"}
        data_vars = {
            "xattn": (("xattn_layer", head_dim, "text_token", "key"), attn, var_attrs),
            "xattn_grad": (("target", "xattn_layer", head_dim, "text_token", "key"), attn_grad, var_attrs),
        }
        coords = {
            "xattn_layer": ("xattn_layer", np.arange(n_layers, dtype=np.int64)),
            head_dim: (head_dim, np.arange(n_heads, dtype=np.int64)),
            "text_token": ("text_token", np.arange(n_text, dtype=np.int64)),
            "text_token_str": ("text_token", np.array(strings, dtype=str)),
            "text_token_mask": ("text_token", mask),
            # The same values the tracer writes for F2's key axis, so both agree whichever is traced.
            "key": ("key", np.arange(n_keys, dtype=np.int64)),
            "key_kind": ("key", kinds),
            "key_patch_row": ("key", rows),
            "key_patch_col": ("key", cols),
        }
        return data_vars, coords
