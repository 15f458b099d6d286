"""Detection targets: the score of one or more detections of a ViT detector, each its own target in one batched
backward pass (``vitcam_nb[hf]``: ``YolosForObjectDetection``, ``OwlViTForObjectDetection``,
``Owlv2ForObjectDetection``).

A detection is one of the model's box predictions: a YOLOS detection token, or an OWL-ViT/OWLv2 patch token. It is
named by its index (``query=i``) or matched to a box the caller gives (``box=(x0, y0, x1, y1)`` in pixels of the
model input, ``match="iou"``: the predicted box with the highest intersection over union). Its score is the logit
of a class (YOLOS: ``class_``, default the detection's top class; OWL: a text query from ``text``) or, with
``score="prob"``, the probability the model's own post-processing reports (YOLOS: softmax over the classes and
"no object"; OWL: sigmoid). The trace states every detection: which one, how it was matched, its box and score.

Example:
    >>> t = detection(query=[0, 2], class_=1)
    >>> t.description
    'detection scores (logit of class 1): detections 0, 2 by index'
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.hf import is_transformers_model
from vitcam_nb.core.errors import ArgumentTypeError, TraceError
from vitcam_nb.core.provenance import array_sha256
from vitcam_nb.targets.base import Target, register_target

__all__ = ["Detection", "box_iou", "detection"]

SCORES = ("logit", "prob")
MATCHES = ("iou",)
YOLOS, OWL = ("YolosForObjectDetection",), ("OwlViTForObjectDetection", "Owlv2ForObjectDetection")


def box_iou(box: Sequence[float], boxes: np.ndarray) -> np.ndarray:
    """Intersection over union of one (x0, y0, x1, y1) box with each row of an (N, 4) array of such boxes.

    Example:
        >>> box_iou((0, 0, 2, 2), np.array([[1, 1, 3, 3], [0, 0, 2, 2], [5, 5, 6, 6]])).round(4).tolist()
        [0.1429, 1.0, 0.0]
    """
    b = np.asarray(box, np.float64)
    boxes = np.asarray(boxes, np.float64)
    w = np.clip(np.minimum(b[2], boxes[:, 2]) - np.maximum(b[0], boxes[:, 0]), 0, None)
    h = np.clip(np.minimum(b[3], boxes[:, 3]) - np.maximum(b[1], boxes[:, 1]), 0, None)
    inter = w * h
    union = (b[2] - b[0]) * (b[3] - b[1]) + (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _boxes(box: object) -> list[tuple[float, ...]]:
    items = [box] if isinstance(box, Sequence) and len(box) == 4 and all(_is_number(v) for v in box) else box
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise TraceError(f"box: expected (x0, y0, x1, y1) in pixels of the model input, or a list of such boxes, "
                         f"got {box!r}")
    out = []
    for b in items:
        if not isinstance(b, Sequence) or len(b) != 4 or not all(_is_number(v) and np.isfinite(v) for v in b):
            raise TraceError(f"box: expected four finite numbers (x0, y0, x1, y1), got {b!r}")
        x0, y0, x1, y1 = (float(v) for v in b)
        if x0 < 0 or y0 < 0:
            raise TraceError(f"box: {tuple(b)} lies outside the image (x0, y0 must be >= 0)")
        if x1 <= x0 or y1 <= y0:
            raise TraceError(f"box: {tuple(b)} is empty; expected x0 < x1 and y0 < y1")
        out.append((x0, y0, x1, y1))
    return out


def _ints(value: object, name: str) -> list[int]:
    items = [value] if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if not isinstance(items, Sequence) or isinstance(items, str) or not items or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in items):
        raise TraceError(f"{name}: expected an index >= 0 or a non-empty list of them, got {value!r}")
    if len(set(items)) != len(items):
        raise TraceError(f"{name}: {list(items)} repeats an index; each detection is one target")
    return [int(v) for v in items]


def _tokenize(texts: list[str], tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of the text queries, padded to the tokenizer's maximum length as OWL's
    processor pads them."""
    if not callable(tokenizer):
        raise ArgumentTypeError(f"tokenizer: text queries need a Hugging Face tokenizer (the OWL model's own, e.g. "
                                f"AutoTokenizer.from_pretrained(name)), got {type(tokenizer).__name__}")
    try:
        enc = tokenizer(texts, padding="max_length", return_tensors="pt")
    except Exception as exc:  # a wrong object can fail in any way; say which argument it was
        raise ArgumentTypeError(f"tokenizer: calling it on the text queries failed ({type(exc).__name__}: "
                                f"{exc})") from exc
    ids = enc["input_ids"] if hasattr(enc, "__getitem__") else None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != len(texts) or ids.is_floating_point():
        raise ArgumentTypeError(f"tokenizer: expected integer input_ids of shape ({len(texts)}, length), got "
                                f"{type(ids).__name__}")
    mask = enc["attention_mask"] if "attention_mask" in enc else torch.ones_like(ids)
    padded = [texts[i] for i in range(len(texts)) if int(ids[i, 0]) <= 0]
    if padded:  # OWL reads a first id of 0 as a padded (absent) query
        raise TraceError(f"text: {padded} tokenise to a row starting with id 0, which OWL reads as no query")
    return ids.long(), torch.as_tensor(mask).long()


class Detection(Target):
    """The scores of chosen detections of a YOLOS or OWL detector (see :func:`detection`).

    One image per trace: the detections a box matches depend on the image, and the trace states them
    (``attrs``); use one instance for one trace at a time. Fixed detections and class (``query``, ``class_``)
    also score a batch, e.g. the perturbed inputs of ``vc.score``.

    Example:
        >>> Detection(box=(0, 0, 8, 8), class_=2, score="prob").settings()["boxes"]
        [[0.0, 0.0, 8.0, 8.0]]
    """

    kind = "detection"

    def __init__(self, box: object = None, query: object = None, class_: int | None = None,
                 text: str | Sequence[str] | None = None, score: str = "logit", match: str = "iou",
                 tokenizer: Callable[..., Any] | None = None, image_query: torch.Tensor | None = None):
        if (box is None) == (query is None):
            raise TraceError("box: give box=(x0, y0, x1, y1) (matched to the predicted boxes) or query=i (a "
                             "detection index), exactly one of them")
        self.boxes = _boxes(box) if box is not None else None
        self.queries = _ints(query, "query") if query is not None else None
        if score not in SCORES:
            raise TraceError(f"score: expected one of {list(SCORES)}, got {score!r}")
        if match not in MATCHES:
            raise TraceError(f"match: expected one of {list(MATCHES)} (the predicted box with the highest IoU), got "
                             f"{match!r}")
        if class_ is not None and (isinstance(class_, bool) or not isinstance(class_, (int, np.integer))
                                   or class_ < 0):
            raise TraceError(f"class_: expected a class (or text query) index >= 0 or None, got {class_!r}")
        self.class_, self.score, self.match = None if class_ is None else int(class_), score, match
        self.texts: list[str] | None = None
        if text is not None:
            texts = [text] if isinstance(text, str) else text
            if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) and t for t in texts):
                raise TraceError(f"text: expected a text query or a non-empty list of them, got {text!r}")
            if len(set(texts)) != len(texts):
                raise TraceError(f"text: {list(texts)} repeats a query")
            if self.class_ is not None and self.class_ >= len(texts):
                raise TraceError(f"class_: {self.class_} is out of range for {len(texts)} text queries "
                                 f"(0..{len(texts) - 1})")
            self.texts = list(texts)
            self.input_ids, self.attention_mask = _tokenize(self.texts, tokenizer)
        elif tokenizer is not None:
            raise TraceError("tokenizer: given without text; it tokenises OWL text queries (text=[...])")
        self.image_query, self._query_embeds = _image_query(image_query, text, self.class_), None
        self.found: list[dict[str, Any]] = []
        what = "logit" if score == "logit" else "probability"
        cls = "the top class" if self.class_ is None else f"class {self.class_}"
        if self.texts is not None:
            cls = "the top text query" if self.class_ is None else f"text query {self.texts[self.class_]!r}"
        elif self.image_query is not None:
            cls = "the image query"
        which = (", ".join(f"box ({', '.join(f'{v:g}' for v in b)})" for b in self.boxes) + " matched by IoU"
                 if self.boxes is not None else
                 f"detection{'s' if len(self.queries) > 1 else ''} {', '.join(map(str, self.queries))} by index")
        self.description = f"detection scores ({what} of {cls}): {which}"

    # ------------------------------------------------------------------ the model

    def check(self, model: torch.nn.Module) -> None:
        owl = is_transformers_model(model, OWL)
        if not owl and not is_transformers_model(model, YOLOS):
            raise TraceError(f"model: a detection target reads {', '.join(YOLOS + OWL)}; got "
                             f"{type(model).__name__}")
        if owl and self.texts is None and self.image_query is None:
            raise TraceError(f"text: {type(model).__name__} scores text or image queries; pass text=[...] and the "
                             "model's tokenizer, or image_query=")
        if not owl and self.image_query is not None:
            raise TraceError(f"image_query: {type(model).__name__} has fixed classes; image queries are for "
                             "OWL-ViT/OWLv2")
        if not owl and self.texts is not None:
            raise TraceError(f"text: {type(model).__name__} has fixed classes ({int(model.config.num_labels)}); "
                             "text queries are for OWL-ViT/OWLv2, choose a class with class_=c")
        if not owl and self.class_ is not None and self.class_ >= int(model.config.num_labels):
            raise TraceError(f"class_: {self.class_} is out of range; the model has {int(model.config.num_labels)} "
                             f"classes (0..{int(model.config.num_labels) - 1}; the no-object logit is not a class)")
        n = self._num_detections(model, owl)
        bad = [q for q in self.queries or [] if q >= n]
        if bad:
            raise TraceError(f"query: {bad[0]} is out of range; the model makes {n} detections (0..{n - 1})")
        if owl and self.image_query is not None:
            size = int(model.config.vision_config.image_size)
            if tuple(self.image_query.shape[-2:]) != (size, size):
                raise TraceError(f"image_query: the model embeds {size}x{size} query images, got "
                                 f"{self.image_query.shape[-2]}x{self.image_query.shape[-1]}")
            self._query_embeds = (model, _embed_image_query(model, self.image_query))
        elif owl:
            vocab = int(model.config.text_config.vocab_size)
            if int(self.input_ids.max()) >= vocab:
                raise TraceError(f"tokenizer: its ids reach {int(self.input_ids.max())} but the model's vocabulary "
                                 f"has {vocab}; use the tokenizer of the same OWL model")

    @staticmethod
    def _num_detections(model: torch.nn.Module, owl: bool) -> int:
        if not owl:
            return int(model.config.num_detection_tokens)
        return int(model.num_patches_height) * int(model.num_patches_width)

    def _outputs(self, model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
        """(logits (B, Q, C), boxes (B, Q, 4) cx, cy, w, h in [0, 1], is OWL, grid width for OWL)."""
        if self.image_query is not None:
            return self._image_guided(model, x)
        if is_transformers_model(model, OWL):
            n, dev = int(x.shape[0]), x.device  # OWL reads the queries of image b at rows b*T..(b+1)*T-1
            out = model(input_ids=self.input_ids.repeat(n, 1).to(dev), pixel_values=x,
                        attention_mask=self.attention_mask.repeat(n, 1).to(dev))
            return out.logits, out.pred_boxes, True, int(out.image_embeds.shape[2])
        out = model(pixel_values=x)
        return out.logits, out.pred_boxes, False, 0

    def _image_guided(self, model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
        """OWL's ``image_guided_detection`` with the query image's embedding made before the trace (check()), so
        the vision tower runs once, on the traced image: its class and box heads, exactly as that method calls them."""
        held, embeds = self._query_embeds or (None, None)
        if held is not model:
            raise TraceError("image_query: its embedding belongs to another model (or none was made); trace with "
                             "vitcam_nb.trace(), which embeds the query image with the traced model first")
        feature_map = model.image_embedder(pixel_values=x)[0]
        b, gh, gw, d = feature_map.shape
        feats = feature_map.reshape(b, gh * gw, d)
        logits = model.class_predictor(image_feats=feats, query_embeds=embeds.to(x.device, feats.dtype))[0]
        return logits, model.box_predictor(feats, feature_map), True, int(gw)

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """(B, K) scores of the K chosen detections. One image is a trace: its detections are matched and stated.
        Several images (``vc.score``'s perturbed inputs) are scored only when nothing is decided per image: the
        detections given by ``query`` and the class by ``class_``."""
        n = int(x.shape[0])
        single = self.image_query is not None or (self.texts is not None and len(self.texts) == 1)
        cls = self.class_ if self.class_ is not None else 0 if single else None  # one query: nothing to choose
        if n != 1 and (self.boxes is not None or cls is None):
            arg = "box" if self.boxes is not None else "class_"
            raise TraceError(f"{arg}: matching a box or choosing the top class is done per image, so this target "
                             "scores one image at a time; trace with vitcam_nb.trace(), and to score perturbed "
                             "inputs (vc.score) give the detection and class it stated: query=i, class_=c")
        h, w = int(x.shape[-2]), int(x.shape[-1])
        for b in self.boxes or []:
            if b[2] > w or b[3] > h:
                raise TraceError(f"box: {b} lies outside the {w}x{h} model input (x1 <= {w}, y1 <= {h}; pixels of "
                                 "the model input)")
        logits, boxes, owl, grid_w = self._outputs(model, x)
        n_det = int(logits.shape[1])
        bad = [q for q in self.queries or [] if q >= n_det]
        if bad:
            raise TraceError(f"query: {bad[0]} is out of range; the model made {n_det} detections (0..{n_det - 1})")
        if n != 1:
            z = logits[:, self.queries, cls]
            if self.score == "prob":
                z = torch.sigmoid(z) if owl else torch.softmax(logits[:, self.queries], dim=-1)[..., cls]
            return z
        return self._score_one(model, logits[0], boxes[0], owl, grid_w, (h, w))

    def _score_one(self, model: torch.nn.Module, logits: torch.Tensor, boxes: torch.Tensor, owl: bool, grid_w: int,
                   size: tuple[int, int]) -> torch.Tensor:
        """The (1, K) scores of one image's detections, matched and stated in ``found``."""
        (h, w), n_det = size, int(logits.shape[0])
        n_cls = int(logits.shape[1]) - (0 if owl else 1)  # YOLOS's last logit is "no object"
        cx, cy, bw, bh = boxes.detach().double().cpu().unbind(-1)
        corners = torch.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], -1)
        corners = corners.numpy()
        picks: list[tuple[int, str]] = []
        if self.boxes is not None:
            for b in self.boxes:
                ious = box_iou(b, corners)
                j = int(np.argmax(ious))  # the first of equal maxima: the lowest index
                if ious[j] <= 0:
                    raise TraceError(f"box: {b} overlaps none of the {n_det} predicted boxes (IoU 0 with each); give "
                                     "a box where the model predicts one, or query=i")
                picks.append((j, f"matched to the given box {_fmt(b)} by IoU {ious[j]:.4f} (the highest of {n_det} "
                                 "predicted boxes; ties go to the lowest index)"))
        else:
            picks = [(q, "named by index (query given)") for q in self.queries]
        scores, self.found = [], []
        for k, (j, how) in enumerate(picks):
            row = logits[j]
            c = int(torch.argmax(row.detach()[:n_cls])) if self.class_ is None else self.class_
            logit = row[c]
            prob = torch.sigmoid(logit) if owl else torch.softmax(row, dim=-1)[c]
            scores.append(logit if self.score == "logit" else prob)
            token = (f"patch token {j} at grid row {j // grid_w}, column {j % grid_w} (trace token {1 + j})" if owl
                     else f"detection token {j} of {n_det} (trace token {1 + j}, kind det)")
            label = (self.texts[c] if self.texts is not None else "image query") if owl else \
                str(model.config.id2label.get(c, f"class {c}"))
            chosen = "given" if self.class_ is not None else "the detection's highest logit" + (
                "" if owl else ", no-object excluded")
            self.found.append({"score": k, "detection": j, "token": token, "match": how,
                               "box": [round(float(v), 4) for v in corners[j]], "class": c, "label": label,
                               "class_choice": chosen, "logit": float(logit.detach()), "prob": float(prob.detach())})
        return torch.stack(scores)[None]

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.batch_scores(model, x)[0]

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        if len(self.found) == n:
            return [f"detection {d['detection']}: {d['label']}" for d in self.found]
        return super().class_labels(model, n)

    def settings(self) -> dict:
        return {"kind": self.kind, "boxes": [list(b) for b in self.boxes] if self.boxes else None,
                "queries": self.queries, "class": self.class_, "text": self.texts, "score": self.score,
                "match": self.match if self.boxes is not None else None,
                "input_ids": self.input_ids.tolist() if self.texts is not None else None,
                "image_query": array_sha256(self.image_query) if self.image_query is not None else None}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "target_score": self.score,
                "target_match": f"{self.match} (given boxes)" if self.boxes is not None else "query index",
                "target_detections": json.dumps(self.found),
                "target_checklist": json.dumps(self.checklist_items())}

    def checklist_items(self) -> dict[str, str]:
        """The checklist's "gradient target" items of this trace: what a score is, and each detection: which one,
        how it was matched, its box, class and score.

        Example:
            >>> Detection(query=0).checklist_items()["matched by"]
            'detection index given (query=)'
        """
        if self.image_query is not None:
            what = ("the image-query logit of the patch's class head: (cos(class embedding, query embedding) + shift) "
                    "x scale" + (", then the sigmoid" if self.score == "prob" else "") + "; the query embedding is "
                    "the class embedding of the query image's box that OWL's embed_image_query picks, made once "
                    "before the trace without gradient")
        elif self.texts is not None:  # OWL (check() refuses text for YOLOS and its absence for OWL)
            what = ("sigmoid of the text-query logit, as the OWL processor's post_process_object_detection scores "
                    "a box") if self.score == "prob" else (
                "the text-query logit of the patch's class head: (cos(class embedding, text embedding) + shift) x "
                "scale, before the sigmoid")
        else:
            what = ("softmax over the classes and no-object of the detection token's class logits, as YOLOS's "
                    "post_process_object_detection scores a box") if self.score == "prob" else (
                "the class logit of the detection token's class head, before the softmax over the classes and "
                "no-object")
        items = {"detection score": what,
                 "matched by": "IoU of each given box with every predicted box (x0, y0, x1, y1 in pixels of the "
                               "model input); the highest wins" if self.boxes is not None
                 else "detection index given (query=)"}
        for d in self.found:
            items[f"score {d['score']}"] = (
                f"detection {d['detection']}, {d['token']}; {d['match']}; predicted box {_fmt(d['box'])} px; "
                f"class {d['class']} {d['label']!r} ({d['class_choice']}); logit {d['logit']:.6g}, "
                f"probability {d['prob']:.6g}")
        return items


def _image_query(image: object, text: object, class_: int | None) -> torch.Tensor | None:
    if image is None:
        return None
    if text is not None:
        raise TraceError("image_query: give text queries or an image query, not both")
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[:2] != (1, 3) \
            or not image.is_floating_point() or not bool(torch.isfinite(image).all()):
        got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ArgumentTypeError(f"image_query: expected a finite (1, 3, H, W) float tensor of pixel values as the OWL "
                                f"processor gives them (query_pixel_values), got {got}")
    if class_ not in (None, 0):
        raise TraceError(f"class_: one image query has index 0 only, got {class_}")
    return image.detach().clone()


def _embed_image_query(model: torch.nn.Module, image: torch.Tensor) -> torch.Tensor:
    """(1, 1, D) query embedding of OWL's ``image_guided_detection``, without gradient, in eval mode (restored)."""
    params = list(model.parameters())
    q = image.to(params[0].device, params[0].dtype) if params else image
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            fmap = model.image_embedder(pixel_values=q)[0]
            feats = fmap.reshape(fmap.shape[0], -1, fmap.shape[-1])
            embeds, _, _ = model.embed_image_query(feats, fmap)
    finally:
        for m, mode in modes:
            m.training = mode
    if embeds is None:
        raise TraceError("image_query: OWL found no box in the query image to take its embedding from")
    return embeds.detach()


def _fmt(b: Sequence[float]) -> str:
    return "(" + ", ".join(f"{float(v):.4g}" for v in b) + ")"


@register_target
def detection(box: object = None, *, query: object = None, class_: int | None = None,
              text: str | Sequence[str] | None = None, score: str = "logit", match: str = "iou",
              tokenizer: Callable[..., Any] | None = None, image_query: torch.Tensor | None = None) -> Detection:
    """The detection target: the scores of chosen detections of a ``YolosForObjectDetection``,
    ``OwlViTForObjectDetection`` or ``Owlv2ForObjectDetection``, each one target of the same backward pass.

    Args:
        box: (x0, y0, x1, y1) in pixels of the model input, or a list of boxes; each is matched to the predicted
            box with the highest IoU (``match="iou"``; the IoU is stated). Give ``box`` or ``query``.
        query: a detection index (a YOLOS detection token, an OWL patch token in raster order) or a list.
        class_: YOLOS: the class whose logit is scored (default: each detection's top class, no-object
            excluded); OWL: the index into ``text`` (default: each detection's top text query).
        text: OWL's text queries (a string or a list), tokenised with ``tokenizer`` as OWL's processor does
            (padded to the maximum length); refused for YOLOS.
        score: ``"logit"`` or ``"prob"`` (YOLOS: softmax over the classes and no-object; OWL: sigmoid).
        image_query: OWL only, instead of ``text``: a query image as a (1, 3, H, W) float tensor of the model's
            input size and normalisation (the processor's ``query_pixel_values``); scored as OWL's
            ``image_guided_detection`` does, its embedding made once before the trace.

    Example:
        >>> detection(box=[(0, 0, 16, 16), (8, 8, 32, 32)], class_=0).boxes
        [(0.0, 0.0, 16.0, 16.0), (8.0, 8.0, 32.0, 32.0)]
    """
    return Detection(box, query, class_, text, score, match, tokenizer, image_query)
