"""``target="prob"`` / ``"logprob"`` of a generative VLM's answer token, over the LM's whole vocabulary.

An answer trace (``vitcam_nb.targets.answer``) stores, for ``n`` answer tokens, ``2n + 1`` differentiated
entries: the answer tokens' logits ``z_k`` (each at the position that predicts it), the sequence log-prob, then
each predicting position's logsumexp over the vocabulary ``lse_k``. So ``log p_k = z_k - lse_k`` exactly, with
``p_k`` the softmax probability over the vocabulary, and its gradient is ``dz_k - dlse_k`` (``dp_k = p_k`` times
that). The classifier rule (a softmax over the traced entries, ``dE``) would be a softmax over a handful of answer
tokens, not the model's probability: it is never used on these traces.

Example:
    >>> w, c = answer_weights(np.array([2.0, 1.0, -3.0, 2.5, 1.5]), [0, 1, 2, 3, 4, -1], Recipe(target="logprob"),
    ...                       {"answer_ids": "7,8"})
    >>> w, c
    ({0: 1.0, 3: -1.0}, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.core.weighting import WEIGHTINGS

__all__ = ["answer_weights", "answer_target_text", "is_answer_trace"]


def is_answer_trace(attrs: Mapping[str, Any]) -> bool:
    """Whether the trace's target is a VLM answer (``target_kind == "answer"``).

    Example:
        >>> is_answer_trace({"target_kind": "answer"}), is_answer_trace({"target_kind": "class"})
        (True, False)
    """
    return str(attrs.get("target_kind", "")) == "answer"


def _count(attrs: Mapping[str, Any]) -> int:
    return len([s for s in str(attrs.get("answer_ids", "")).split(",") if s.strip()])


def answer_weights(logits: np.ndarray, classes: list[int], recipe: Recipe, attrs: Mapping[str, Any]
                   ) -> tuple[dict[int, float], int]:
    """The combination of stored gradients that is the recipe's target for an answer trace (first key: the
    class's own position), and the class: answer token ``k`` (``0..n-1``) or the sequence log-prob (``n``).

    Example:
        >>> w, c = answer_weights(np.array([2.0, -1.0, 2.5]), [0, 1, 2, -1], Recipe(target="prob"),
        ...                       {"answer_ids": "7"})
        >>> round(w[0], 4), round(w[2], 4), c  # p = exp(2.0 - 2.5)
        (0.6065, -0.6065, 0)
    """
    n = _count(attrs)
    z = np.asarray(logits, dtype=np.float64).ravel()
    if isinstance(recipe.class_, str):  # "topK": the answer tokens ranked by logit (never a logsumexp entry)
        rank = int(recipe.class_[3:])
        if not 1 <= rank <= n:
            raise RecipeError(f"class_: {recipe.class_} ranks the {n} answer tokens of this trace by logit; pick "
                              f"top1..top{n}, or an answer token by index (0..{n - 1}; the sequence log-prob {n})")
        cls = int(np.argsort(-z[:n], kind="stable")[rank - 1])
    else:
        cls = int(recipe.class_)
    if not 0 <= cls <= n:
        raise RecipeError(f"class_: {cls} is not an answer token of this trace (answer tokens 0..{n - 1}, the "
                          f"sequence log-prob {n}; entries above are the vocabulary logsumexps, not targets)")
    if cls not in classes:
        raise RecipeError(f"class_: entry {cls} was not traced (traced: {[c for c in classes if c >= 0]})")
    pos = classes.index(cls)
    if recipe.target == "logit" or recipe.layer_fusion == "rollout":
        return {pos: 1.0}, cls
    if attrs.get("backward_rule") == "chefer_lrp":
        raise RecipeError(f"target: a chefer_lrp trace holds each entry's relevance; {recipe.target!r} is not a "
                          "linear combination of them. Use target='logit'")
    if cls == n:  # the sequence score is already sum_k log p_k over the vocabulary
        return ({pos: 1.0}, cls) if recipe.target == "logprob" else ({pos: float(np.exp(z[cls]))}, cls)
    lse = n + 1 + cls
    if z.size != 2 * n + 1 or lse not in classes:
        raise RecipeError(f"target: {recipe.target!r} needs the vocabulary logsumexp at the answer token's position, "
                          "which this answer trace lacks (traced before it was stored, or with a subset of "
                          "entries); use target='logit' or trace again")
    if recipe.target == "logprob":
        return {pos: 1.0, classes.index(lse): -1.0}, cls
    p = float(np.exp(z[cls] - z[lse]))
    return {pos: p, classes.index(lse): -p}, cls


def answer_target_text(recipe: Recipe, attrs: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the differentiated scalar, how its gradient was obtained) for the checklist of a gradient recipe on an
    answer trace; None for other traces, attention rollout and weightings that use no gradient or scores.

    Example:
        >>> answer_target_text(Recipe(target="logprob", class_=0), {"target_kind": "answer", "answer_ids": "7"})[0]
        "the log-probability log p = z - lse over the LM's whole vocabulary of answer token 0"
    """
    weighting = WEIGHTINGS.get(recipe.weighting)
    if not is_answer_trace(attrs) or recipe.layer_fusion == "rollout" or not weighting.uses_gradient \
            or weighting.scores:
        return None
    n = _count(attrs)
    cls = recipe.class_
    what = (f"the sequence log-prob (sum over the {n} answer tokens of log softmax over the LM's vocabulary)"
            if is_int(cls) and int(cls) == n else f"answer token {cls}" if is_int(cls) else
            f"the answer token ranked {str(cls)[3:]} by logit among the {n} answer tokens ({cls})")
    if recipe.target == "logit":
        scalar = (what if is_int(cls) and int(cls) == n else
                  f"the LM's logit z of {what} at the position predicting it (pre-softmax)")
        return scalar, "direct: stored gradient of that entry"
    if is_int(cls) and int(cls) == n:
        return ({"prob": f"the sequence probability exp({what})", "logprob": what}[recipe.target],
                "direct: the stored gradient of the sequence log-prob" + (
                    " times the sequence probability" if recipe.target == "prob" else ""))
    scalar = {"prob": "the softmax probability p = exp(z - lse) over the LM's whole vocabulary of ",
              "logprob": "the log-probability log p = z - lse over the LM's whole vocabulary of "}[recipe.target]
    how = ("derived exactly from the stored gradients: dlog p = dz - dlse, lse the logsumexp over the vocabulary "
           "at that position (traced as its own entry)")
    return scalar + what, how if recipe.target == "logprob" else how.replace("dlog p = dz - dlse",
                                                                                "dp = p (dz - dlse)")
