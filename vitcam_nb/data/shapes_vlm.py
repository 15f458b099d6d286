"""Synthetic known-answer visual question answering: a circle and a cross in named colours, questions about them.

Each 64x64 image holds one circle and one cross (the *class objects*), each in a quadrant of its own and in a colour
of its own from the named palette :data:`COLOURS`, with small distractors (thin segments and dots, none a circle or a
cross and none in a palette colour) over the textured background of :func:`vitcam_nb.data.shapes.shapes`. Every image
comes with one question about one of the two objects, its answer, and the pixel mask of that object (what a map of
the answer should point at). Three question types (:data:`QUESTION_TYPES`):

* ``colour``: "what colour is the cross" -> "red" (4 answers; chance 1/4);
* ``where``: "where is red" -> "top left" (the quadrant of the object in that colour, two words; chance 1/4);
* ``shape``: "what shape is red" -> "circle" (2 answers; chance 1/2).

The words form a fixed vocabulary :data:`VOCAB` defined here (no tokenizer): :func:`encode` / :func:`decode` map
words to ids. :func:`prompt_ids` gives the model's input ids for a question in LLaVA's order: ``<bos>``,
:data:`IMAGE_TOKENS` copies of the ``<image>`` placeholder (one per vision patch, as
``LlavaForConditionalGeneration`` expects them expanded), then the question's words; the last word's logits give the
answer's first word (no separator token, so the word that names the asked-about object, its shape or its colour, is
the query that reads the image tokens); :func:`answer_ids` the answer's words and ``<eos>``. ``?`` and ``<answer>``
stay in the vocabulary (their ids are unchanged) but no prompt holds them.
Everything is vectorised over the batch and driven by one ``numpy.random.Generator``, so a seed fixes the images,
questions and masks exactly.

Example:
    >>> images, questions, answers, masks, kinds = shapes_vqa(4, seed=0)
    >>> images.shape, masks.shape, len(questions)
    ((4, 64, 64, 3), (4, 64, 64), 4)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.data.shapes import background, coverage, paint, rotate, sd_box

__all__ = ["ANSWER", "ANSWERS", "BOS", "COLOURS", "EOS", "IMAGE", "IMAGE_TOKENS", "OBJECTS", "PAD", "QUADRANTS",
           "QUESTION_TYPES", "VOCAB", "answer_ids", "chance_levels", "decode", "encode", "prompt_ids", "shapes_vqa",
           "vqa_generator_settings"]

OBJECTS: tuple[str, ...] = ("circle", "cross")
#: The named palette; an object's colour is the named RGB plus a small per-channel jitter.
COLOURS: dict[str, tuple[int, int, int]] = {"red": (225, 35, 35), "green": (35, 190, 55), "blue": (40, 80, 235),
                                            "yellow": (235, 215, 30)}
#: Quadrant k (0 top left, 1 top right, 2 bottom left, 3 bottom right) and its answer.
QUADRANTS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right")
QUESTION_TYPES: tuple[str, ...] = ("colour", "where", "shape")

PAD, BOS, EOS, IMAGE, ANSWER = "<pad>", "<bos>", "<eos>", "<image>", "<answer>"
#: The word-level vocabulary; a word's id is its index.
VOCAB: tuple[str, ...] = (PAD, BOS, EOS, IMAGE, ANSWER, "what", "colour", "is", "the", "where", "shape", "?", *OBJECTS,
                          *COLOURS, "top", "bottom", "left", "right")
_IDS = {w: i for i, w in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, ANSWER_ID = (_IDS[w] for w in (PAD, BOS, EOS, IMAGE, ANSWER))
#: Image placeholder tokens per image: the 16x16-pixel patches of a 64x64 image, a 4x4 grid (each quadrant 2x2
#: patches; the class token is not passed to the LM).
IMAGE_TOKENS = 16
#: The answers of each question type.
ANSWERS: dict[str, tuple[str, ...]] = {"colour": tuple(COLOURS), "where": QUADRANTS, "shape": OBJECTS}

_SIZE = 64
_RADIUS = (7.0, 10.0)  # object size (circle radius) in pixels
_EXTENT = 1.25  # every object lies within 1.25 r of its centre (cross corners: sqrt(1 + 0.3^2) r = 1.04 r)
_MAX_ROTATION_DEG = 15.0
_CROSS_ARM = 0.3  # a cross's arm half-width / arm length: thin arms show in every 8x8 patch the cross covers
_JITTER = 15.0  # per-channel jitter of the palette colours
_N_DISTRACTORS = (1, 3)  # inclusive
_DISTRACTOR_GREY = (60.0, 200.0)  # distractors are grey (never a palette colour) ...
_DISTRACTOR_OFFSET = 70.0  # ... at least this much brighter or darker than the background mean


def shapes_vqa(n: int, seed: int, *, objects: bool = False) -> tuple:
    """Generate ``n`` images with one question each.

    Returns
    -------
    images : uint8 ``(n, 64, 64, 3)`` RGB.
    questions : ``n`` strings of space-separated :data:`VOCAB` words (e.g. ``"what colour is the cross"``).
    answers : ``n`` strings (e.g. ``"red"``, ``"top left"``, ``"circle"``).
    masks : bool ``(n, 64, 64)``: the pixels of the object the question asks about.
    kinds : int64 ``(n,)``: the question type, an index into :data:`QUESTION_TYPES`.
    objects : only with ``objects=True``, a sixth item: a dict of both objects per image, ``"masks"`` bool
        ``(n, 2, 64, 64)``, ``"colour"`` and ``"quadrant"`` int64 ``(n, 2)`` (indices into :data:`COLOURS` and
        :data:`QUADRANTS`; object 0 is the circle, 1 the cross) and ``"asked"`` int64 ``(n,)`` (the object each
        question asks about); the same images and questions as without it.

    Example:
        >>> _, q, a, m, k = shapes_vqa(3, seed=1)
        >>> all(ans in ANSWERS[QUESTION_TYPES[t]] for ans, t in zip(a, k)), bool(m.any(axis=(1, 2)).all())
        (True, True)
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ArgumentTypeError(f"n: expected an int, got {type(n).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ArgumentTypeError(f"seed: expected an int, got {type(seed).__name__}")
    if n < 0:
        raise ArgumentError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    size = _SIZE
    img = background(rng, n, size) if n else np.zeros((0, size, size, 3), np.float32)
    bg_mean = img.mean(axis=(1, 2))
    # object k (0 circle, 1 cross): a quadrant and a palette colour of its own
    quadrant = np.argsort(rng.random((n, 4)), axis=1)[:, :2]
    colour = np.argsort(rng.random((n, len(COLOURS))), axis=1)[:, :2]
    radius = rng.uniform(*_RADIUS, size=(n, 2)).astype(np.float32)
    angle = np.deg2rad(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG, size=(n, 2))).astype(np.float32)
    half = size / 2
    lo = radius * _EXTENT + 1.0
    centre_x = (quadrant % 2) * half + lo + rng.random((n, 2)).astype(np.float32) * (half - 2 * lo)
    centre_y = (quadrant // 2) * half + lo + rng.random((n, 2)).astype(np.float32) * (half - 2 * lo)
    palette = np.array(list(COLOURS.values()), np.float32)
    rgb = np.clip(palette[colour] + rng.uniform(-_JITTER, _JITTER, size=(n, 2, 3)), 0, 255).astype(np.float32)
    kinds = rng.integers(0, len(QUESTION_TYPES), size=n)
    asked = rng.integers(0, 2, size=n)

    _distractors(rng, img, bg_mean)
    coords = np.arange(size, dtype=np.float32) + 0.5
    masks = np.zeros((n, 2, size, size), dtype=bool)
    for k in range(2):
        u, v = rotate(coords[None, None, :] - centre_x[:, k, None, None],
                      coords[None, :, None] - centre_y[:, k, None, None], angle[:, k])
        r = radius[:, k, None, None]
        w = _CROSS_ARM * r  # half-width of the cross's arms
        sd = np.sqrt(u * u + v * v) - r if k == 0 else np.minimum(sd_box(u, v, r, w), sd_box(u, v, w, r))
        paint(img, coverage(sd), rgb[:, k])
        masks[:, k] = sd < 0.0

    rows = np.arange(n)
    names, colour_names = np.array(OBJECTS), np.array(list(COLOURS))
    obj, col, quad = names[asked], colour_names[colour[rows, asked]], np.array(QUADRANTS)[quadrant[rows, asked]]
    questions = np.where(kinds == 0, np.char.add("what colour is the ", obj),
                         np.where(kinds == 1, np.char.add("where is ", col), np.char.add("what shape is ", col)))
    answers = np.where(kinds == 0, col, np.where(kinds == 1, quad, obj))
    images = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    out = (images, questions.tolist(), answers.tolist(), masks[rows, asked], kinds.astype(np.int64))
    if objects:
        return (*out, {"masks": masks, "colour": colour.astype(np.int64), "quadrant": quadrant.astype(np.int64),
                      "asked": asked.astype(np.int64)})
    return out


def _distractors(rng: np.random.Generator, img: np.ndarray, bg_mean: np.ndarray) -> None:
    """Paint 1-3 grey thin segments or dots per image in place (under the objects, which are painted after)."""
    n, size = img.shape[0], img.shape[1]
    coords = np.arange(size, dtype=np.float32) + 0.5
    count = rng.integers(_N_DISTRACTORS[0], _N_DISTRACTORS[1] + 1, size=n)
    luma = bg_mean.mean(axis=1)
    for k in range(_N_DISTRACTORS[1]):
        kind = rng.integers(0, 2, size=n)
        cx, cy = (rng.uniform(2.0, size - 2.0, size=(2, n)).astype(np.float32))
        ang = rng.uniform(0.0, 2 * np.pi, size=n).astype(np.float32)
        length = rng.uniform(6.0, 14.0, size=n).astype(np.float32)
        width = rng.uniform(1.0, 2.0, size=n).astype(np.float32)
        dot = rng.uniform(1.5, 2.5, size=n).astype(np.float32)
        grey = rng.uniform(*_DISTRACTOR_GREY, size=n).astype(np.float32)
        # a grey at least _DISTRACTOR_OFFSET from the background brightness: flipped to the other side when too close
        grey = np.where(np.abs(grey - luma) < _DISTRACTOR_OFFSET,
                        np.where(luma > 127.5, luma - _DISTRACTOR_OFFSET, luma + _DISTRACTOR_OFFSET), grey)
        u, v = rotate(coords[None, None, :] - cx[:, None, None], coords[None, :, None] - cy[:, None, None], ang)
        sd = np.where((kind == 0)[:, None, None], sd_box(u, v, length[:, None, None] / 2, width[:, None, None] / 2),
                      np.sqrt(u * u + v * v) - dot[:, None, None])
        sd[k >= count] = np.inf
        paint(img, coverage(sd), np.repeat(np.clip(grey, 0, 255)[:, None], 3, axis=1))


def encode(text: str | Sequence[str]) -> list[int]:
    """Word ids of ``text`` (space-separated :data:`VOCAB` words, or a list of words).

    Example:
        >>> decode(encode("where is red"))
        'where is red'
    """
    words = text.split() if isinstance(text, str) else text
    if not isinstance(words, Sequence) or not all(isinstance(w, str) for w in words):
        raise ArgumentTypeError(f"text: expected a string or a list of words, got {type(text).__name__}")
    unknown = [w for w in words if w not in _IDS]
    if unknown:
        raise ArgumentError(f"text: words {unknown} are not in the shapes-vlm vocabulary {list(VOCAB)}")
    return [_IDS[w] for w in words]


def decode(ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
    """The words of ``ids`` joined by spaces; with ``skip_special`` (default) pad, bos, eos, image and answer are
    left out.

    Example:
        >>> decode([1, 14, 2]), decode([1, 14, 2], skip_special=False)
        ('red', '<bos> red <eos>')
    """
    flat = np.asarray(ids).reshape(-1) if not hasattr(ids, "detach") else ids.detach().cpu().numpy().reshape(-1)
    if flat.size and (not np.issubdtype(flat.dtype, np.integer) or flat.min() < 0 or flat.max() >= len(VOCAB)):
        raise ArgumentError(f"ids: expected integer ids in [0, {len(VOCAB)}), got {flat.tolist()[:8]}")
    special = {PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, ANSWER_ID} if skip_special else set()
    return " ".join(VOCAB[i] for i in flat.tolist() if i not in special)


def prompt_ids(question: str) -> list[int]:
    """The model's input ids for ``question``: ``<bos>``, :data:`IMAGE_TOKENS` ``<image>`` placeholders (already
    expanded, one per image token the projector emits, row-major over the 4x4 patch grid), then the question's words;
    the last word's logits give the answer's first word. The answer's ids (:func:`answer_ids`) follow when an answer
    is scored by teacher forcing.

    Example:
        >>> ids = prompt_ids("where is red")
        >>> len(ids), ids.count(VOCAB.index("<image>")), ids.index(VOCAB.index("<image>"))
        (20, 16, 1)
    """
    if not isinstance(question, str):
        raise ArgumentTypeError(f"question: expected a string, got {type(question).__name__}")
    if not question.split():
        raise ArgumentError("question: empty")
    return [BOS_ID] + [IMAGE_ID] * IMAGE_TOKENS + encode(question)


def answer_ids(answer: str, eos: bool = True) -> list[int]:
    """The ids of ``answer``'s words, followed by ``<eos>`` (what the model was trained to emit) unless ``eos=False``.

    Example:
        >>> decode(answer_ids("top left"), skip_special=False)
        'top left <eos>'
    """
    if not isinstance(answer, str):
        raise ArgumentTypeError(f"answer: expected a string, got {type(answer).__name__}")
    if not answer.split():
        raise ArgumentError("answer: empty")
    return encode(answer) + ([EOS_ID] if eos else [])


def chance_levels() -> dict[str, float]:
    """Accuracy of a uniform guess per question type (answers are uniform by construction).

    Example:
        >>> chance_levels()
        {'colour': 0.25, 'where': 0.25, 'shape': 0.5}
    """
    return {t: 1.0 / len(ANSWERS[t]) for t in QUESTION_TYPES}


def vqa_generator_settings() -> dict:
    """The constants that define the images and questions (pixels at 64x64), for the model card.

    Example:
        >>> vqa_generator_settings()["objects"]
        ['circle', 'cross']
    """
    return {"objects": list(OBJECTS), "colours": {k: list(v) for k, v in COLOURS.items()},
            "colour_jitter": _JITTER, "quadrants": list(QUADRANTS), "question_types": list(QUESTION_TYPES),
            "questions": {"colour": "what colour is the <object>", "where": "where is <colour>",
                          "shape": "what shape is <colour>"},
            "object_radius": list(_RADIUS), "max_rotation_deg": _MAX_ROTATION_DEG,
            "placement": "circle and cross (arm half-width 0.3 r) in two different quadrants (uniform), "
                         "each inside its quadrant",
            "n_distractors": list(_N_DISTRACTORS), "distractors": "grey thin segments and dots",
            "background": "as vitcam_nb.data.shapes", "image_size": _SIZE}
