"""Models to explain: the bundled known-answer ViTs, any timm model, or your own module.

The bundled models (``shapes-vit``, ``shapes-vit-reg4``, ``shapes-vit-shortcut``) are small timm
``VisionTransformer`` s trained on :func:`vitcam_nb.data.shapes`, shipped as safetensors with a JSON
model card (``shapes-video``: a tiny VideoMAE trained on :func:`vitcam_nb.data.shapes_video.shape_clips`;
``shapes-vlm``: a tiny LLaVA answering questions about :func:`vitcam_nb.data.shapes_vlm.shapes_vqa` images).
They load offline, and their weights file is checked against the card's SHA-256 before anything is read from it.
Every other name goes to ``timm.create_model`` unchanged.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcam_nb.core.errors import (
    ArgumentError,
    ArgumentIndexError,
    ArgumentTypeError,
    MissingExtraError,
    RandomWeightsWarning,
    WeightsError,
    user_stacklevel,
)
from vitcam_nb.core.provenance import LOADED_KEY, file_sha256, weights_sha256
from vitcam_nb.data.segmenter import LinearSegmenter
from vitcam_nb.data.shapes import shortcut_marks
from vitcam_nb.data.train_video import HF_CLASS as HF_VIDEO_CLASS
from vitcam_nb.data.train_video import build_video_model
from vitcam_nb.data.train_vlm import HF_CLASS as HF_VLM_CLASS
from vitcam_nb.data.train_vlm import build_vlm

__all__ = ["BUNDLED_PREFIX", "bundled_names", "list_models", "load_model", "model_card", "required_extra",
           "sample_image"]

BUNDLED_PREFIX = "shapes-"
_SAMPLES_FILE = "shapes_samples.npz"
_SAMPLE_KINDS = ("shapes", "shortcut", "shortcut-random")


def _models_dir() -> Path:
    return Path(str(resources.files("vitcam_nb.data").joinpath("models")))


def _samples_path() -> Path:
    return Path(str(resources.files("vitcam_nb.data").joinpath("samples", _SAMPLES_FILE)))


def bundled_names() -> list[str]:
    """Names of the bundled models (those with a model card in the package).

    Example:
        >>> "shapes-vit" in bundled_names()
        True
    """
    return sorted(p.stem for p in _models_dir().glob("*.json"))


def model_card(name: str) -> dict:
    """The model card (a dict, parsed from the bundled JSON) of bundled model ``name``.

    Example:
        >>> model_card("shapes-vit")["classes"]
        ['circle', 'square', 'triangle', 'cross', 'ring']
    """
    path = _models_dir() / f"{name}.json"
    if not path.is_file():
        raise ArgumentError(_unknown_name_message(name))
    return json.loads(path.read_text())


def list_models() -> list[dict]:
    """One summary dict per bundled model: name, task, test_accuracy, weights_sha256 (the safetensors file's
    hash, also under ``weights_file_sha256``; a trace's ``weights_sha256`` hashes tensors), classes, description,
    and ``extra``: the extra its class needs (``"hf"``), None when the base install loads it.

    Example:
        >>> [m["name"] for m in list_models()]  # doctest: +NORMALIZE_WHITESPACE
        ['shapes-video', 'shapes-vit', 'shapes-vit-reg4', 'shapes-vit-seg', 'shapes-vit-shortcut', 'shapes-vlm',
         'shapes-yolos']
    """
    rows = []
    for name in bundled_names():
        card = model_card(name)
        keys = ("name", "task", "test_accuracy", "weights_sha256", "classes", "description")
        row = {k: card[k] for k in keys}
        # The card's weights_sha256 is the safetensors file's hash, not a trace's tensor hash: named as such.
        row["weights_file_sha256"] = card["weights_sha256"]
        row["extra"] = required_extra(card)  # None: the base install loads it
        if "test_accuracy_random_mark" in card:
            row["test_accuracy_random_mark"] = card["test_accuracy_random_mark"]
        rows.append(row)
    return rows


def _pretrained_cfg(card: dict) -> dict:
    # JSON turns tuples into lists; timm's configs use tuples for sizes, mean, std and label names.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in card["pretrained_cfg"].items()}


def _video_cfg(card: dict) -> dict:
    # A transformers model has no timm config; this one states the bundled name and the clip normalisation.
    return {"architecture": "videomae_shapes", "tag": card["name"], "source": "vitcam_nb bundled",
            "mean": tuple(card["mean"]), "std": tuple(card["std"]), "label_names": tuple(card["classes"])}


def _load_from_files(weights_path: str | Path, card_path: str | Path) -> torch.nn.Module:
    """Build a bundled-style model from a safetensors file and its JSON card, hash checked first."""
    from safetensors.torch import load_file
    from timm.models.vision_transformer import VisionTransformer

    weights_path, card_path = Path(weights_path), Path(card_path)
    card = json.loads(card_path.read_text())
    _check_extra(card)
    expected = card.get("weights_sha256")
    actual = file_sha256(weights_path)
    if actual != expected:
        raise ArgumentError(
            f"weights file {weights_path} does not match its model card {card_path.name}: "
            f"expected sha256 {expected}, got {actual}. The file is damaged or was replaced; "
            "reinstall vitcam_nb (or retrain with `python -m vitcam_nb.data.train`)."
        )
    # The segmentation model's card names its class, the video model and the detector their transformers class;
    # every other bundled model is a plain timm ViT.
    if card.get("timm_class") == "vitcam_nb.data.segmenter.LinearSegmenter":
        model = LinearSegmenter(**card["timm_kwargs"])
    elif card.get("hf_class") == HF_VIDEO_CLASS:
        model = build_video_model(card["hf_config"])
    elif card.get("hf_class") == "transformers.YolosForObjectDetection":
        model = _bundled_yolos(card)
    elif card.get("hf_class") == HF_VLM_CLASS:
        model = build_vlm(card["hf_config"])
    else:
        model = VisionTransformer(**card["timm_kwargs"])
    model.load_state_dict(load_file(str(weights_path)), strict=True)
    cfg = _pretrained_cfg(card) if "pretrained_cfg" in card else _video_cfg(card)
    cfg[LOADED_KEY] = {"origin": f"bundled {card.get('name', weights_path.stem)} (file sha256 {actual})",
                       "weights_sha256": weights_sha256(model)}
    model.pretrained_cfg = cfg
    model.default_cfg = cfg
    return model.eval()


def _bundled_yolos(card: dict) -> torch.nn.Module:
    """The bundled detector ``shapes-yolos``: a transformers YOLOS built from the card's config (``vitcam_nb[hf]``)."""
    import transformers

    return transformers.YolosForObjectDetection(transformers.YolosConfig(**card["hf_config"]))


# The optional package a bundled card's class comes from, and the extra of pyproject.toml that installs it.
_EXTRAS = {"transformers": "hf"}


def required_extra(card: dict) -> str | None:
    """The extra (``"hf"``) that installs the package the class of a bundled model ``card`` comes from, or None
    when the base install builds it.

    Example:
        >>> required_extra(model_card("shapes-video")), required_extra(model_card("shapes-vit"))
        ('hf', None)
    """
    cls = card.get("hf_class") or card.get("timm_class") or ""
    return _EXTRAS.get(cls.split(".", 1)[0])


def _check_extra(card: dict) -> None:
    """Refuse, naming the extra, a bundled model whose package is not installed (before its weights are read)."""
    extra = required_extra(card)
    if extra is None:
        return
    package = next(p for p, e in _EXTRAS.items() if e == extra)
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise MissingExtraError(
            f"model {card.get('name')!r} is a {card.get('hf_class') or card.get('timm_class')} and needs "
            f"{package}, which is not installed: pip install -e '.[{extra}]' in your vitcam_nb checkout") from err


def _unknown_name_message(name: str) -> str:
    return (
        f"unknown model {name!r}. Bundled models (offline, no download): {', '.join(bundled_names())}. "
        "Any other name is passed to timm.create_model, e.g. "
        'vc.load_model("vit_base_patch16_224", pretrained=True) with the weights in the timm / '
        "Hugging Face cache (timm.list_models() lists the architectures timm knows)."
    )


def load_model(name_or_model: str | torch.nn.Module, *, pretrained: bool = False, weights: str | Path | None = None,
               **timm_kwargs: Any) -> torch.nn.Module:
    """Return a model ready to trace, in eval mode; :func:`vitcam_nb.core.provenance.weights_origin` of it (and
    every trace's ``weights_origin``) says which weights it holds.

    * a bundled name (``shapes-vit``, ``shapes-vit-reg4``, ``shapes-vit-shortcut``, and the segmentation model
      ``shapes-vit-seg``, a :class:`~vitcam_nb.data.segmenter.LinearSegmenter`, the video classifier
      ``shapes-video``, a tiny transformers ``VideoMAEForVideoClassification`` that takes one clip (4, 3, 32, 32)
      normalised as :func:`vitcam_nb.data.train_video.normalise_clips` does; a card naming
      ``hf_class`` ``transformers.YolosForObjectDetection``, as ``python -m vitcam_nb.data.train_detection`` writes
      for the detector ``shapes-yolos``, builds that class, ``vitcam_nb[hf]``; ``shapes-vlm``, a tiny transformers
      ``LlavaForConditionalGeneration`` whose prompts :func:`vitcam_nb.data.shapes_vlm.prompt_ids` builds, with
      ``pixel_values`` from :func:`vitcam_nb.data.train_vlm.normalise`, ``vitcam_nb[hf]``): loaded from the
      package after checking the weights file's SHA-256 against the model card (``ValueError`` on a
      mismatch; a model whose class needs an extra that is not installed, as ``shapes-video`` and
      ``shapes-yolos`` need ``[hf]``, raises :class:`~vitcam_nb.core.errors.MissingExtraError` naming it),
      with ``pretrained_cfg`` set so timm's data config reproduces the training preprocessing;
    * any other string: ``timm.create_model(name, **timm_kwargs)``. ``pretrained=True`` loads the published
      weights from the timm / Hugging Face cache (downloading them only when the hub can be reached; offline and
      not cached, a :class:`~vitcam_nb.core.errors.WeightsError` says at once which file was looked for and
      where); ``weights=PATH`` loads a safetensors state dict (strict: every tensor must fit). Without either the
      weights are random-init, and a :class:`~vitcam_nb.core.errors.RandomWeightsWarning` says so when the
      architecture has published weights;
    * a ``torch.nn.Module``: returned as is.

    Example:
        >>> m = load_model("shapes-vit")
        >>> m.pretrained_cfg["label_names"]
        ('circle', 'square', 'triangle', 'cross', 'ring')
        >>> m2 = load_model("vit_base_patch16_224", pretrained=True)  # doctest: +SKIP
    """
    if not isinstance(pretrained, bool):
        raise ArgumentTypeError(f"pretrained: expected True or False, got {pretrained!r}")
    if pretrained and weights is not None:
        raise ArgumentError("pretrained, weights: give one source of weights, not both")
    extra = sorted(timm_kwargs) + (["pretrained"] if pretrained else []) + (["weights"] if weights is not None else [])
    if isinstance(name_or_model, torch.nn.Module):
        if extra:
            raise ArgumentError(f"keyword arguments {extra} apply to timm names, not to a module")
        return name_or_model
    if not isinstance(name_or_model, str):
        raise ArgumentTypeError(f"expected a model name or a torch.nn.Module, got {type(name_or_model).__name__}")
    name = name_or_model
    if name in bundled_names():
        if extra:
            raise ArgumentError(f"bundled model {name!r} takes no keyword arguments, got {extra}")
        models = _models_dir()
        return _load_from_files(models / f"{name}.safetensors", models / f"{name}.json")
    if name.startswith(BUNDLED_PREFIX):
        raise ArgumentError(_unknown_name_message(name))
    if "pretrained_cfg_overlay" in timm_kwargs and (pretrained or weights is not None):
        raise ArgumentError("pretrained_cfg_overlay: vitcam_nb sets where the weights come from; leave it out")
    state = _read_safetensors(weights) if weights is not None else None
    cfg = _published_cfg(name)
    origin, overlay = None, {}
    if pretrained:
        origin, overlay = _pretrained_source(name, cfg)
    model = _create(name, pretrained, overlay, timm_kwargs)
    if state is not None:
        _load_state(model, state, Path(weights), name)
        origin = f"file {Path(weights).name} (file sha256 {file_sha256(Path(weights))})"
    elif not pretrained and cfg is not None and (cfg.hf_hub_id or cfg.url):
        warnings.warn(f"{name} was built with random-init weights (no pretrained=True, no weights=PATH): its maps "
                      f"explain an untrained network, not the published {cfg.architecture}.{cfg.tag}. Pass "
                      "pretrained=True (CLI: --pretrained) or weights=PATH (CLI: --weights PATH).",
                      RandomWeightsWarning, stacklevel=user_stacklevel())
    if origin is not None:
        cfg_dict = dict(getattr(model, "pretrained_cfg", None) or {})
        cfg_dict[LOADED_KEY] = {"origin": origin, "weights_sha256": weights_sha256(model)}
        model.pretrained_cfg = model.default_cfg = cfg_dict
    return model.eval()


def _create(name: str, pretrained: bool, overlay: dict, timm_kwargs: dict) -> torch.nn.Module:
    import timm

    if overlay:
        timm_kwargs = {**timm_kwargs, "pretrained_cfg_overlay": overlay}
    try:
        return timm.create_model(name, pretrained=pretrained, **timm_kwargs)
    except RuntimeError as err:
        if "Unknown model" in str(err):
            raise ArgumentError(_unknown_name_message(name)) from err
        raise


def _published_cfg(name: str) -> Any:
    """timm's pretrained config of ``name`` (the default tag when none is given), None for an unknown name."""
    from timm.models import get_pretrained_cfg

    if name.startswith(("hf-hub:", "local-dir:")):
        return None
    try:
        return get_pretrained_cfg(name)
    except RuntimeError as err:  # a tag the architecture does not have
        raise ArgumentError(f"{_unknown_name_message(name)} ({err})") from err


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "") or os.environ.get("TRANSFORMERS_OFFLINE", "")
    return flag.upper() in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


def _reachable(host: str) -> bool:
    """Whether ``host`` answers on 443 within 3 s: offline, huggingface_hub retries for about a minute instead."""
    if _offline():
        return False
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return False
    return True


def _cached_file(cfg: Any) -> tuple[str, str, Path | None, str]:
    """Where timm would read ``cfg``'s weights: (source, host, the cached file or None, where it was looked for)."""
    from timm.models._builder import _resolve_pretrained_source

    load_from, loc = _resolve_pretrained_source(cfg.to_dict())
    if load_from == "hf-hub":
        from huggingface_hub import constants, try_to_load_from_cache

        if isinstance(loc, tuple):  # the config names the file
            repo, files = loc[0], [loc[1]]
        else:  # timm reads the safetensors file when there is one
            repo, files = loc, ["model.safetensors", "pytorch_model.bin"]
        repo, _, revision = repo.partition("@")
        for file in files:
            found = try_to_load_from_cache(repo, file, revision=revision or None)
            if isinstance(found, str):
                return f"hf-hub:{repo}", "huggingface.co", Path(found), constants.HF_HUB_CACHE
        return f"hf-hub:{repo}", "huggingface.co", None, f"{constants.HF_HUB_CACHE} ({' or '.join(files)})"
    if load_from == "url":
        from urllib.parse import urlparse

        url = urlparse(loc)
        path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url.path)
        return loc, url.hostname or "", path if path.is_file() else None, str(path)
    raise WeightsError(f"pretrained: timm names no downloadable weights for {cfg.architecture}.{cfg.tag}; pass "
                       "weights=PATH (CLI: --weights PATH) with a safetensors state dict")


def _pretrained_source(name: str, cfg: Any) -> tuple[str, dict]:
    """The origin text of ``name``'s published weights and the timm overlay that reads them from the cache; a
    ``WeightsError`` at once when they are not cached and the hub cannot be reached."""
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise WeightsError(f"pretrained: timm has no published weights for {name!r}; pass weights=PATH "
                           "(CLI: --weights PATH) with a safetensors state dict, or a name from "
                           "timm.list_pretrained()")
    full = f"{cfg.architecture}.{cfg.tag}" if cfg.tag else cfg.architecture
    source, host, found, looked = _cached_file(cfg)
    if found is not None:
        return f"pretrained {full} from {source} (file sha256 {file_sha256(found)})", {"file": str(found)}
    if not _reachable(host):
        raise WeightsError(
            f"pretrained: the weights of {full} ({source}) are not in the local cache ({looked}) and {host} cannot "
            f"be reached (offline). Fill the cache where there is a connection (timm.create_model({full!r}, "
            "pretrained=True)) and copy it here, or pass weights=PATH (CLI: --weights PATH) with a safetensors file "
            "of this architecture's state dict.")
    return f"pretrained {full} from {source} (downloaded)", {}


def _read_safetensors(weights: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(weights, (str, Path)):
        raise ArgumentTypeError(f"weights: expected a path to a .safetensors file, got {type(weights).__name__}")
    path = Path(weights)
    if not path.is_file():
        raise WeightsError(f"weights: {path} is not a file")
    if path.suffix != ".safetensors":
        raise WeightsError(f"weights: {path.name} is not a .safetensors file; pickle-based files (.pth, .bin, .pt) "
                           "are not read because loading them can run code. Convert once: safetensors.torch."
                           "save_file(torch.load(p, weights_only=True), 'model.safetensors')")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightsError(f"weights: {path.name} could not be read as safetensors ({err})") from err


def _load_state(model: torch.nn.Module, state: dict, path: Path, name: str) -> None:
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        raise WeightsError(f"weights: {path.name} does not fit {name}: {str(err).splitlines()[-1].strip()}") from err
    if missing or unexpected:
        raise WeightsError(f"weights: {path.name} does not fit {name}: missing {missing[:4]}"
                           f"{'…' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                           f"{'…' if len(unexpected) > 4 else ''}")


@lru_cache(maxsize=1)
def _samples() -> dict[str, np.ndarray]:
    with np.load(_samples_path(), allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def sample_image(
    kind: str = "shapes", index: int = 0, with_mask: bool = False
) -> np.ndarray | tuple[np.ndarray, int, np.ndarray]:
    """A fixed bundled example image, uint8 (64, 64, 3).

    ``kind``: ``"shapes"`` (honest images; index i < 5 shows class i, then the classes repeat),
    ``"shortcut"`` (with the class-coded corner mark the shortcut model relies on) or
    ``"shortcut-random"`` (the same images with a mark that disagrees with the class). With
    ``with_mask=True`` returns ``(image, label, mask)``, the mask being the class object's pixels.

    Example:
        >>> img = sample_image()
        >>> img.shape, img.dtype
        ((64, 64, 3), dtype('uint8'))
        >>> img, label, mask = sample_image("shapes", 3, with_mask=True)
        >>> label, mask.dtype
        (3, dtype('bool'))
    """
    if kind not in _SAMPLE_KINDS:
        raise ArgumentError(f"kind must be one of {_SAMPLE_KINDS}, got {kind!r}")
    data = _samples()
    images = data["images"]
    if not -len(images) <= index < len(images):
        raise ArgumentIndexError(f"index {index} out of range: {len(images)} bundled {kind!r} samples")
    image = images[index].copy()
    mask = data["masks"][index].copy()
    if kind != "shapes":
        mark_class = data[kind.replace("-", "_") + "_mark_class"][index : index + 1]
        marked, mark = shortcut_marks(
            np.random.default_rng(0), image[None].astype(np.float32), mark_class, 64, 1.0, randomise=False
        )
        image, mask = marked[0].astype(np.uint8), mask & ~mark[0]
    if not with_mask:
        return image
    return image, int(data["labels"][index]), mask
