"""BLIP image-text matching (``vitcam_nb[vlm]``): an adapter for Hugging Face ``BlipForImageTextRetrieval`` and
the :func:`itm` target.

Vision side: the sites F1..F6 (and the extended ones) of every layer of ``vision_model.encoder.layers``, laid
out as for a timm ViT (class embedding first, then the patches in raster order). Text side: the extra site
``xattn``, the cross-attention probabilities of every text-encoder layer, text tokens as queries over the
vision tokens (CLS + patches) as keys. :func:`vitcam_nb.vlm.xattn.xattn_cam` turns them into heatmaps.

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
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.base import Adapter, SiteSpec
from vitcam_nb.errors import TraceError
from vitcam_nb.targets import Target

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


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct Hugging Face config object reachable from the model's modules (top, vision, text)."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            seen.setdefault(id(cfg), cfg)
    for cfg in list(seen.values()):
        for name in ("vision_config", "text_config"):
            sub = getattr(cfg, name, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                seen.setdefault(id(sub), sub)
    return list(seen.values())


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
        saved = [(cfg, cfg._attn_implementation_internal) for cfg in _configs(model)]
        try:
            for cfg, impl in saved:
                if impl not in (None, "eager"):
                    # The private field, not the property setter: the setter would also rewrite sub-configs.
                    cfg._attn_implementation_internal = "eager"
            yield
        finally:
            for cfg, impl in saved:
                cfg._attn_implementation_internal = impl

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
        ids = getattr(target, "input_ids", None)
        if isinstance(target, ItmTarget) and ids is not None and len(ids) == n_text:
            strings, mask = list(target.tokens), target.attention_mask.numpy().astype(np.int64)
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


# -- the image-text matching target ----------------------------------------------------------------------
def _as_ids(value: Any, field: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a 1-D or (1, L) tensor, array or list of ints."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{field}: expected a 1-D or (1, L) tensor of ints, got {type(value).__name__}") from exc
        if arr.dtype.kind not in "biufc":
            raise TraceError(f"{field}: expected a 1-D or (1, L) tensor of ints, got {value!r:.80}")
        t = torch.from_numpy(arr) if arr.size else torch.zeros(arr.shape, dtype=torch.int64)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TraceError(f"{field}: expected integer token ids, got dtype {t.dtype}")
    shape = tuple(t.shape)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1:
        raise TraceError(f"{field}: expected shape (L,) or (1, L) for one text, got {shape}")
    if t.numel() == 0:
        raise TraceError(f"{field}: is empty; expected at least one token")
    return t.to(torch.int64)


class ItmTarget(Target):
    """BLIP's image-text matching head logits (no match, match) for one text; built by :func:`itm`.

    Example:
        >>> t = ItmTarget(torch.tensor([101, 2003, 102]), torch.ones(3, dtype=torch.int64), True, None)
        >>> t.labels, t.tokens
        (['no match', 'match'], ['[101]', '[2003]', '[102]'])
    """

    kind = "itm"
    labels = ["no match", "match"]

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, match: bool, tokenizer: Any):
        self.input_ids, self.attention_mask, self.match, self.tokenizer = input_ids, attention_mask, match, tokenizer
        ids = [int(i) for i in input_ids]
        tokens = None
        if tokenizer is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
            tokens = [str(s) for s in tokenizer.convert_ids_to_tokens(ids)]
        self.tokens = tokens if tokens is not None and len(tokens) == len(ids) else [f"[{i}]" for i in ids]
        kept = [i for i, m in zip(ids, attention_mask.tolist()) if m]
        text = None
        if tokenizer is not None and hasattr(tokenizer, "decode"):
            with contextlib.suppress(Exception):  # a user's tokenizer may not take these arguments
                text = str(tokenizer.decode(kept, skip_special_tokens=True))
        if text is None:
            text = " ".join(s for s, m in zip(self.tokens, attention_mask.tolist()) if m)
        self.text = text if len(text) <= 120 else text[:117] + "..."
        self.description = f"BLIP image-text matching head logits (no match, match) for the text {self.text!r}"

    def _special_ids(self, model: torch.nn.Module | None) -> set[int]:
        special = getattr(self.tokenizer, "all_special_ids", None)
        if special is not None:
            return {int(i) for i in special}
        if model is None:
            return set()
        cfg = model.config.text_config
        ids = (getattr(cfg, name, None) for name in ("pad_token_id", "bos_token_id", "sep_token_id",
                                                     "eos_token_id"))
        return {int(i) for i in ids if isinstance(i, (int, np.integer))}

    def check(self, model: torch.nn.Module) -> None:
        if not is_blip_itm(model):
            raise TraceError(f"targets: itm() needs a transformers BlipForImageTextRetrieval, got "
                             f"{type(model).__module__}.{type(model).__name__}")
        cfg = model.config.text_config
        vocab = int(cfg.vocab_size)
        if int(self.input_ids.max()) >= vocab or int(self.input_ids.min()) < 0:
            raise TraceError(f"input_ids: token ids must lie in 0..{vocab - 1} (the text encoder's vocabulary), "
                             f"got {self.input_ids.tolist()}")
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        if limit and len(self.input_ids) > limit:
            raise TraceError(f"input_ids: {len(self.input_ids)} tokens but the text encoder takes at most {limit}")
        special = self._special_ids(model)
        kept = [int(i) for i, m in zip(self.input_ids, self.attention_mask) if m]
        if special and all(i in special for i in kept):
            raise TraceError(f"input_ids: holds only special tokens {kept} (ids {sorted(special)} are special); "
                             "give the text to match")
        if not any(hasattr(layer, "crossattention") for layer in model.text_encoder.encoder.layer):
            raise TraceError("model: its text encoder has no cross-attention layers (text_config.is_decoder is "
                             "False), so it cannot score image-text matching")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(pixel_values=x, input_ids=self.input_ids[None].to(x.device),
                    attention_mask=self.attention_mask[None].to(x.device), use_itm_head=True)
        logits = getattr(out, "itm_score", None)
        if logits is None and isinstance(out, (tuple, list)):
            logits = out[0]
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (1, 2):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TraceError(f"model: expected ITM logits of shape (1, 2), got {shape}")
        return logits[0]

    def choose(self, scores: torch.Tensor) -> list[int]:
        # Both ITM logits are traced (the chosen one first), so class_="top1" works whichever one is higher.
        return [1, 0] if self.match else [0, 1]

    def settings(self) -> dict:
        return {"kind": self.kind, "input_ids": [int(i) for i in self.input_ids],
                "attention_mask": [int(i) for i in self.attention_mask], "match": bool(self.match)}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "itm_match": int(self.match), "itm_text": self.text}


def itm(input_ids: Any, attention_mask: Any = None, *, match: bool = True, tokenizer: Any = None) -> ItmTarget:
    """Target BLIP's image-text matching head for one text: the two ITM logits (no match, match).

    The trace differentiates both logits, the chosen one first (``match=True``: "match", class 1), plus the
    expected logit, so ``Recipe(target="prob", class_=1)`` gives the ITM match probability and
    ``class_="top1"`` works whichever logit is higher.

    Args:
        input_ids: token ids of one text, shape (L,) or (1, L), L >= 1 (e.g. ``processor.tokenizer(text,
            return_tensors="pt").input_ids``).
        attention_mask: 0/1 mask of the same shape (default: all ones).
        match: differentiate the "match" logit (True) or the "no match" logit (False).
        tokenizer: optional; its ``convert_ids_to_tokens`` names the text tokens (else "[id]") and its
            ``all_special_ids`` lets a text of only special tokens be refused.

    Example:
        >>> t = itm([101, 1037, 3899, 102])
        >>> t.tokens, t.choose(None)
        (['[101]', '[1037]', '[3899]', '[102]'], [1, 0])
    """
    if not isinstance(match, (bool, np.bool_)):
        raise TraceError(f"match: expected True or False, got {match!r}")
    ids = _as_ids(input_ids, "input_ids")
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        given = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else None
        mask = _as_ids(attention_mask, "attention_mask")
        if mask.shape != ids.shape:
            raise TraceError(f"attention_mask: shape {given or tuple(mask.shape)} does not match input_ids "
                             f"{tuple(getattr(input_ids, 'shape', ids.shape))}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise TraceError(f"attention_mask: expected 0/1 values, got {mask.tolist()}")
        if not bool(mask.any()):
            raise TraceError("attention_mask: masks every token; at least one must be 1")
    target = ItmTarget(ids, mask, bool(match), tokenizer)
    special = target._special_ids(None)
    kept = [int(i) for i, m in zip(ids, mask) if m]
    if special and all(i in special for i in kept):
        raise TraceError(f"input_ids: holds only special tokens {kept}; give the text to match")
    return target


__all__ = ["BlipAdapter", "ItmTarget", "is_blip_itm", "itm"]
