"""Adapters for Hugging Face ``transformers`` video transformers (``vitcam_nb[hf]``): VideoMAE, TimeSformer, ViViT.

A video model's tokens sit on a (frame or tubelet, row, column) grid. Each adapter reports that grid as
``(t, h, w)`` from its patch embedding, stores the patch tokens in ``(t, y, x)`` raster order after the prefix
tokens, and takes one clip (T, C, H, W) or (1, T, C, H, W) as a normalised float tensor used as given. A clip
with another frame count than the model's ``config.num_frames`` is refused with both numbers before any model
call: none of the three families interpolates its time embedding consistently (VideoMAE's sinusoid table has
one row per tubelet of the configured clip; TimeSformer resizes its time embedding but its layers reshape with
``config.num_frames``; ViViT interpolates in space only).

- VideoMAE (``videomae.encoder.layer``): no class token; tubelets of ``tubelet_size`` frames; the classifier
  averages the tokens (``use_mean_pooling``) or reads token 0, a patch token.
- ViViT (``vivit.layers``): the transformers 5 ViT layer (``q_proj``..``o_proj``) on a class token and tubelets.
- TimeSformer (``timesformer.encoder.layer``, divided space-time attention): each layer runs temporal attention
  (each patch position over the frames, no class token) then spatial attention (each frame's patches with a
  copy of the class token). Its token stream is stored in ``(t, y, x)`` order (the model's own order is
  ``(y, x, t)``); the sites inside the spatial attention (F1, F3, attn_out) see one class-token copy per frame,
  stored as the mean of the copies (their values are equal at F1; at F3 and attn_out the layer averages them)
  with the gradient summed over the copies (the gradient with respect to the shared value). The two attention
  kinds are the extra sites ``attn_time`` and ``attn_space`` (softmax matrices per layer); F2 does not exist.

Example:
    >>> HfVideoMaeAdapter().matches(object()), HfTimesformerAdapter().family
    (False, 'hf_timesformer')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.hf import HfSiteSpec, HfVitAdapter
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError, TraceError

__all__ = ["HfTimesformerAdapter", "HfVideoMaeAdapter", "HfVivitAdapter", "PerClip", "VideoAdapterMixin",
           "clip_tensor"]


def clip_tensor(image: object, frames: int, size: tuple[int, int]) -> torch.Tensor:
    """One clip as the (1, T, C, H, W) float32 tensor a video model takes, refusing any other shape, frame
    count or size with both numbers.

    Example:
        >>> tuple(clip_tensor(torch.zeros(4, 3, 8, 8), 4, (8, 8)).shape)
        (1, 4, 3, 8, 8)
        >>> clip_tensor(torch.zeros(6, 3, 8, 8), 4, (8, 8))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: image: the model was built for clips of 4 frames (config.num_frames), got 6 frames; ...
    """
    if isinstance(image, np.ndarray) and np.issubdtype(image.dtype, np.floating):
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor) or not image.is_floating_point():
        raise ArgumentTypeError(f"image: a video model takes one clip as a normalised float tensor (T, C, H, W) or "
                                f"(1, T, C, H, W), e.g. a video processor's pixel_values; got {type(image).__name__}"
                                + (f" of dtype {image.dtype}" if isinstance(image, (torch.Tensor, np.ndarray)) else ""))
    shape = tuple(int(v) for v in image.shape)
    if image.ndim == 5 and shape[0] != 1:
        raise TraceError(f"image: a batch of {shape[0]} clips {shape}; trace one clip (T, C, H, W) at a time")
    if image.ndim not in (4, 5) or shape[-3] != 3:
        raise TraceError(f"image: expected one clip (T, C, H, W) or (1, T, C, H, W) with C = 3, got shape {shape}")
    if shape[-4] != frames:
        raise TraceError(f"image: the model was built for clips of {frames} frames (config.num_frames), got "
                         f"{shape[-4]} frames; sample {frames} frames from the video (this family does not "
                         "interpolate its time embedding)")
    if shape[-2:] != tuple(size):
        raise TraceError(f"image: the model was built for {size[0]}x{size[1]} frames (config.image_size), got "
                         f"{shape[-2]}x{shape[-1]}; resize the frames (e.g. with the model's video processor)")
    t = image.detach().to("cpu", torch.float32).reshape(1, *shape[-4:]).clone()
    if not torch.isfinite(t).all():
        raise TraceError("image: contains NaN or inf values; expected finite pixel values")
    return t


def _display(t: torch.Tensor) -> np.ndarray:
    """(T, H, W, 3) uint8 frames for display: the clip's values min-max scaled over the whole clip (the tensor
    is used as given; its normalisation is unknown, so it is not undone)."""
    frames = t[0].permute(0, 2, 3, 1).numpy().astype(np.float64)
    lo, hi = float(frames.min()), float(frames.max())
    scaled = (frames - lo) / (hi - lo) if hi > lo else np.zeros_like(frames)
    return np.round(scaled * 255.0).astype(np.uint8)


class PerClip(torch.nn.Module):
    """Wraps a module applied to a (clips x rows, ...) tensor so that the tensor passes through ``clip`` as
    (clips, rows, ...) first: a hook on ``clip`` sees one leading entry per clip, and the model continues from
    that tensor (same values), so its gradient exists.

    Example:
        >>> m = PerClip(torch.nn.Identity(), rows=2)
        >>> tuple(m(torch.zeros(4, 3)).shape)
        (4, 3)
    """

    def __init__(self, inner: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.inner, self.rows, self.clip = inner, rows, torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_clip = x.reshape(x.shape[0] // self.rows, self.rows, *x.shape[1:])
        return self.inner(self.clip(per_clip).reshape(x.shape))


class VideoAdapterMixin:
    """What the three video families share: the clip input, the (t, h, w) grid and the time facts.

    Example:
        >>> HfVivitAdapter().video
        True
    """

    video = True
    token_order = "(t, y, x) as the model orders them"

    def tubelet(self, model: torch.nn.Module) -> tuple[int, int, int]:
        """(frames, rows, columns) of pixels one token covers (``tubelet_size`` frames, 1 without one)."""
        cfg = model.config
        return int(getattr(cfg, "tubelet_size", 1)), int(cfg.patch_size), int(cfg.patch_size)

    def frames(self, model: torch.nn.Module) -> int:
        """The clip length the model was built for (``config.num_frames``)."""
        return int(model.config.num_frames)

    def prepare_input(self, model: torch.nn.Module, image: object, processor: object = None) -> Any:
        """The clip as a :class:`vitcam_nb.preprocess.PreparedInput` (tensor (1, T, C, H, W), display
        (T, H, W, 3)); refused before any model call when it does not fit the model."""
        from vitcam_nb.preprocess import PreparedInput  # the preprocessing module imports the adapters

        if processor is not None:
            raise TraceError("processor: a video model takes the processor's pixel_values as the clip; call the "
                             "video processor yourself and pass its pixel_values as image")
        size = HfVitAdapter.configured_size(self, model)  # type: ignore[arg-type]
        t = clip_tensor(image, self.frames(model), size)
        facts = {"input_kind": "clip tensor (used as given)", "clip_frames": int(t.shape[1]),
                 "display": "frames min-max scaled over the clip for display only"}
        return PreparedInput(t, _display(t), facts)

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        clip_tensor(x[:1], self.frames(model), HfVitAdapter.configured_size(self, model))  # type: ignore[arg-type]

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, ...]:
        # A 3-D convolution keeps (tubelets, rows, columns); TimeSformer's 2-D one runs on every frame.
        return tuple(int(v) for v in output.shape[-3:])

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        tt, th, tw = self.tubelet(model)
        return {
            "num_heads": heads, "head_dim": int(cfg.hidden_size) // heads, "embed_dim": int(cfg.hidden_size),
            "global_pool": self.pooling(model),  # type: ignore[attr-defined]
            "patch_size": f"{th}x{tw}" if th != tw else th,
            "tubelet_size": f"{tt}x{th}x{tw} (frames x rows x columns)",
            "num_frames": self.frames(model),
            "token_order": self.token_order,
            "dynamic_img_size": 0,
            "position_encoding": self.position_encoding(model),  # type: ignore[attr-defined]
            "hf_class": type(model).__name__,
            "hf_name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
            "hf_attn_implementation": str(cfg._attn_implementation_internal or "default"),
            "attention_backend": self.attention_backend(model),
        }

    def attention_backend(self, model: torch.nn.Module) -> str:
        """How the attention ran for the trace (the checklist's attention backend)."""
        impl = model.config._attn_implementation_internal or "default"
        return f"eager attention (the model's {impl} implementation switched to eager for the trace and " \
               "restored after) so F2 exists"


@declare_family(needs="transformers", priority=310)
class HfVideoMaeAdapter(VideoAdapterMixin, HfVitAdapter):
    """transformers ``VideoMAEModel`` / ``VideoMAEForVideoClassification``: tubelet tokens, no class token.

    Example:
        >>> HfVideoMaeAdapter().relative_sites("videomae.encoder.layer")["F3"].hook("")
        'videomae.encoder.layer.{layer}.attention.output.dense:input'
    """

    family = "hf_videomae"
    classes = ("VideoMAEModel", "VideoMAEForVideoClassification")
    base_prefix = "videomae"

    def _check_layout(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        first = layers[0]
        if not hasattr(getattr(first, "attention", None), "output") or not hasattr(first, "layernorm_before"):
            raise ArgumentTypeError(f"model: {type(model).__name__}'s layers are not the transformers 5 VideoMAE "
                                    f"layout (attention.attention, attention.output.dense, layernorm_before/after); "
                                    f"install transformers>=5")

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        return {
            "F1": HfSiteSpec("layernorm_before", "output", "LayerNorm output before multi-head attention", path),
            "F2": HfSiteSpec("attention.attention", "output[1]", "softmax attention matrix per head (the weights "
                             "the eager attention returns)", path),
            "F3": HfSiteSpec("attention.output.dense", "input",
                             "attention output, heads concatenated, before the output projection", path),
            "F4": HfSiteSpec("layernorm_after", "output", "LayerNorm output before the MLP", path),
            "F5": HfSiteSpec("output.dense", "output", "MLP output (before the residual the output module adds)",
                             path),
            "F6": HfSiteSpec("", "output", "residual stream after the MLP (layer output)", path),
            "resid_pre": HfSiteSpec("", "input", "residual stream entering the layer", path),
            "attn_out": HfSiteSpec("attention", "output", "attention output after the output projection", path),
            "resid_mid": HfSiteSpec("layernorm_after", "input", "residual stream after the attention residual", path),
        }

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        return []  # VideoMAEEmbeddings adds no class token

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attention.attention for blk in self.blocks(model)]

    def pooling(self, model: torch.nn.Module) -> str:
        if not hasattr(model, "classifier"):
            return "none"
        if getattr(model, "fc_norm", None) is not None:
            return "avg (mean of all tubelet tokens, then fc_norm)"
        return "token 0 after the final LayerNorm (a tubelet token: VideoMAE has no class token)"

    def position_encoding(self, model: torch.nn.Module) -> str:
        return "fixed sinusoid table, one row per tubelet token"


@declare_family(needs="transformers", priority=320)
class HfVivitAdapter(VideoAdapterMixin, HfVitAdapter):
    """transformers ``VivitModel`` / ``VivitForVideoClassification``: a class token, then tubelet tokens.

    Example:
        >>> HfVivitAdapter().prefix_kinds(None)
        ['cls']
    """

    family = "hf_vivit"
    classes = ("VivitModel", "VivitForVideoClassification")
    base_prefix = "vivit"

    def tubelet(self, model: torch.nn.Module) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in model.config.tubelet_size)
        return t, h, w


@declare_family(needs="transformers", priority=330)
class HfTimesformerAdapter(VideoAdapterMixin, HfVitAdapter):
    """transformers ``TimesformerModel`` / ``TimesformerForVideoClassification`` with divided space-time
    attention (see the module docstring for the class-token copies and the two attention kinds).

    Example:
        >>> sorted(HfTimesformerAdapter().relative_sites(""))[:3]
        ['F1', 'F3', 'F4']
    """

    family = "hf_timesformer"
    classes = ("TimesformerModel", "TimesformerForVideoClassification")
    base_prefix = "timesformer"
    token_order = "(t, y, x): the model orders its patch tokens (y, x, t); the trace reorders them"
    #: the sites computed on the spatial attention's per-frame sequences (one class-token copy per frame)
    per_frame = ("F1", "F3", "attn_out")

    def _check_layout(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        first = layers[0]
        kind = getattr(model.config, "attention_type", "?")
        if kind != "divided_space_time":
            raise ArgumentTypeError(f"model: TimeSformer with attention_type={kind!r}; the hf_timesformer adapter "
                                    f"reads divided_space_time (the published models) only")
        if not hasattr(first, "temporal_attention") or not hasattr(first.attention, "output"):
            raise ArgumentTypeError(f"model: {type(model).__name__}'s layers are not the transformers 5 TimeSformer "
                                    f"layout (temporal_attention, attention, temporal_dense); install transformers>=5")

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        copies = " (per-frame class-token copies: mean stored, gradient summed)"
        return {
            "F1": HfSiteSpec("layernorm_before", "output", "LayerNorm output before the spatial attention" + copies,
                             path),
            "F3": HfSiteSpec("attention.output.dense", "input", "spatial attention output, heads concatenated, "
                             "before the output projection" + copies, path),
            "F4": HfSiteSpec("layernorm_after", "output", "LayerNorm output before the MLP", path),
            "F5": HfSiteSpec("output", "output", "MLP output", path),
            "F6": HfSiteSpec("", "output", "residual stream after the MLP (layer output)", path),
            "resid_pre": HfSiteSpec("", "input", "residual stream entering the layer", path),
            "attn_out": HfSiteSpec("attention", "output", "spatial attention output after the output projection"
                                   + copies, path),
            "resid_mid": HfSiteSpec("layernorm_after", "input", "residual stream after the temporal and spatial "
                                    "attention residuals", path),
        }

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for blk in self.blocks(model) for m in (blk.temporal_attention.attention, blk.attention.attention)]

    def attention_backend(self, model: torch.nn.Module) -> str:
        return "explicit softmax attention (TimeSformer's own; read at attn_drop, the identity in eval mode)"

    def position_encoding(self, model: torch.nn.Module) -> str:
        return "absolute (space) + absolute time embedding"

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, ...]:
        # The 2-D patch convolution runs on every frame: (batch x frames, channels, rows, columns).
        return self.frames(model), int(output.shape[-2]), int(output.shape[-1])

    def patches(self, model: torch.nn.Module) -> int:
        """Patch positions per frame."""
        h, w = HfVitAdapter.configured_size(self, model)
        _, ph, pw = self.tubelet(model)
        return (h // ph) * (w // pw)

    def _drops(self, model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
        blocks = self.blocks(model)
        return {"attn_time": [b.temporal_attention.attention for b in blocks],
                "attn_space": [b.attention.attention for b in blocks]}

    @contextlib.contextmanager
    def patched(self, model: torch.nn.Module) -> Iterator[None]:
        """Each attention's ``attn_drop`` (the identity in eval mode, applied to the softmax matrix) wrapped so
        that the matrix passes through a module with one row per clip; restored on exit, also on error."""
        rows = {"attn_time": self.patches(model), "attn_space": self.frames(model)}
        saved = [(attn, attn.attn_drop, rows[site]) for site, mods in self._drops(model).items() for attn in mods]
        try:
            for attn, drop, n in saved:
                attn.attn_drop = PerClip(drop, n)
            yield
        finally:
            for attn, drop, _ in saved:
                attn.attn_drop = drop

    def extra_sites(self, model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
        # Inside a trace the matrices are read at PerClip.clip (batch-major); outside one the names are what count.
        return {site: [(a.attn_drop.clip if isinstance(a.attn_drop, PerClip) else a.attn_drop, "output")
                       for a in mods] for site, mods in self._drops(model).items()}

    def assemble_extra(self, model: torch.nn.Module, site: str, acts: list[np.ndarray], grads: list[np.ndarray],
                       target: object) -> tuple[dict, dict]:
        t = self.frames(model)
        size = HfVitAdapter.configured_size(self, model)
        _, ph, pw = self.tubelet(model)
        gh, gw = size[0] // ph, size[1] // pw
        # one clip: (layer, rows, head, query, key) and (target, layer, rows, head, query, key)
        act, grad = np.stack(acts)[:, 0], np.stack(grads, axis=1)[:, :, 0]
        n_layers, heads = act.shape[0], act.shape[2]
        if site == "attn_time":
            # batch rows are the patch positions (y, x); query and key are frames
            act = act.reshape(n_layers, gh, gw, heads, t, t)
            grad = grad.reshape(grad.shape[0], n_layers, gh, gw, heads, t, t)
            dims = ("attn_time_layer", "attn_time_row", "attn_time_col", "head", "time_query", "time_key")
            coords = {"attn_time_layer": np.arange(n_layers), "attn_time_row": np.arange(gh),
                      "attn_time_col": np.arange(gw), "time_query": np.arange(t), "time_key": np.arange(t)}
        else:
            # batch rows are the frames; query and key: the class-token copy, then the frame's patches (y, x)
            n = act.shape[-1]
            act = act.reshape(n_layers, t, heads, n, n)
            grad = grad.reshape(grad.shape[0], n_layers, t, heads, n, n)
            dims = ("attn_space_layer", "frame_of_attn", "head", "space_query", "space_key")
            kinds = np.array(["cls"] + ["patch"] * (n - 1))
            coords = {"attn_space_layer": np.arange(n_layers), "frame_of_attn": np.arange(t),
                      "space_query": np.arange(n), "space_key": np.arange(n),
                      "space_query_kind": ("space_query", kinds), "space_key_kind": ("space_key", kinds)}
        coords["head"] = np.arange(heads)
        return {site: (dims, act), f"{site}_grad": (("target", *dims), grad)}, coords

    def arrange(self, model: torch.nn.Module, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        """Tokens in (t, y, x) order after the class token; the per-frame sites' sequences merged into one."""
        t = self.frames(model)
        if site in self.per_frame:
            lead, (bt, n, c) = tensor.shape[:-3], tensor.shape[-3:]
            x = tensor.reshape(*lead, bt // t, t, n, c)
            cls = x[..., 0, :]
            # activations arrive as (batch, ...), gradients as (targets, batch, ...)
            cls = cls.sum(dim=-2, keepdim=True) if tensor.ndim == 4 else cls.mean(dim=-2, keepdim=True)
            return torch.cat([cls, x[..., 1:, :].reshape(*lead, bt // t, t * (n - 1), c)], dim=-2)
        n = tensor.shape[-2] - 1
        order = [0] + [1 + p * t + f for f in range(t) for p in range(n // t)]
        return tensor.index_select(-2, torch.tensor(order, device=tensor.device))
