"""Train the bundled known-answer VLM ``shapes-vlm`` on :func:`~vitcam_nb.data.shapes_vlm.shapes_vqa` (CPU, one
thread, seeded).

Usage::

    python -m vitcam_nb.data.train_vlm            # writes shapes-vlm.safetensors and shapes-vlm.json

The model is a transformers ``LlavaForConditionalGeneration`` built from a tiny config (random init): a CLIP vision
tower (4 layers, width 64, 16x16 patches on 64x64 images: a 4x4 grid of image tokens, each quadrant 2x2 of them),
LLaVA's two-layer MLP projector reading the tower's second-to-last layer without its class token
(``vision_feature_layer=-2``, ``vision_feature_select_strategy="default"``, as LLaVA-1.5), and a 3-layer Llama decoder
over the word vocabulary of :mod:`vitcam_nb.data.shapes_vlm`, prompted in LLaVA's order (image tokens, then the
question, whose last word predicts the answer). The loss is the cross-entropy of the answer's words and ``<eos>``
under teacher forcing (the prompt's positions carry no loss) plus an auxiliary loss (weight ``aux_weight``): a linear
head on the projector's output (what the LM reads) predicts each image token's colour, shape (of the object covering
most of its patch, or none: :func:`token_labels`) and quadrant. Without it the answers stayed at chance for thousands
of steps (the LM had no signal to read the image by); the head is dropped after training (not in the saved model,
which is a plain LLaVA). The training images come from a fixed pool drawn once from ``train_seed`` (rendering is
slower than a step here); the test accuracy (greedy answers, per question type) uses a seed never used in training.
Runs are deterministic for a given torch build (one thread, deterministic algorithms).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.data.shapes_vlm import (
    ANSWER_ID,
    BOS_ID,
    EOS_ID,
    IMAGE_ID,
    IMAGE_TOKENS,
    PAD_ID,
    QUESTION_TYPES,
    VOCAB,
    answer_ids,
    chance_levels,
    decode,
    prompt_ids,
    shapes_vqa,
    vqa_generator_settings,
)
from vitcam_nb.data.train import learning_rate, library_versions, write_bundled

NAME = "shapes-vlm"
HF_CLASS = "transformers.LlavaForConditionalGeneration"
MODELS_DIR = Path(__file__).resolve().parent / "models"
#: CLIP's image statistics (what a CLIPImageProcessor normalises with).
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
#: Greedy answers are read for at most this many tokens (the longest answer, "top left", and <eos>).
MAX_ANSWER_TOKENS = 3

CONFIG: dict = {
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 256,
                      "num_hidden_layers": 4, "num_attention_heads": 4, "image_size": 64, "patch_size": 16,
                      "num_channels": 3, "hidden_act": "gelu", "layer_norm_eps": 1e-6, "attention_dropout": 0.0},
    "text_config": {"model_type": "llama", "vocab_size": len(VOCAB), "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "max_position_embeddings": 128, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID,
                    "eos_token_id": EOS_ID, "tie_word_embeddings": False, "attention_dropout": 0.0},
    "image_token_index": IMAGE_ID, "image_seq_length": IMAGE_TOKENS, "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "tie_word_embeddings": False,
}
TRAIN: dict = {"steps": 12_000, "batch_size": 32, "lr": 2e-3, "min_lr": 2e-5, "weight_decay": 0.01,
               "warmup_steps": 200, "grad_clip": 1.0, "pool": 24_000, "n_test": 600, "log_every": 500,
               "train_seed": 30_000, "test_seed": 90_030, "aux_weight": 0.5}


def build_vlm(config: dict | None = None) -> torch.nn.Module:
    """A random-init ``LlavaForConditionalGeneration`` from the tiny config (eager attention, so the LM's attention
    probabilities can be read).

    Example:
        >>> build_vlm().config.image_token_id == VOCAB.index("<image>")
        True
    """
    import transformers

    cfg = transformers.LlavaConfig(**(config or CONFIG))
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    return transformers.LlavaForConditionalGeneration(cfg)


def normalise(images: np.ndarray) -> torch.Tensor:
    """uint8 (n, 64, 64, 3) -> float32 ``pixel_values`` (n, 3, 64, 64): ``(x / 255 - MEAN) / STD`` with CLIP's
    statistics.

    Example:
        >>> normalise(np.zeros((1, 64, 64, 3), np.uint8)).shape
        torch.Size([1, 3, 64, 64])
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def teacher_forcing_batch(questions: list[str], answers: list[str]) -> tuple[torch.Tensor, ...]:
    """``input_ids`` (prompt + answer + ``<eos>``, right-padded with ``<pad>``), ``attention_mask`` and ``targets``
    (the next word at every position whose next word is an answer word or ``<eos>``, -100 elsewhere).

    Example:
        >>> ids, mask, tgt = teacher_forcing_batch(["what shape is red ?"], ["circle"])
        >>> decode(tgt[tgt >= 0].tolist(), skip_special=False)
        'circle <eos>'
    """
    rows = [(prompt_ids(q), answer_ids(a)) for q, a in zip(questions, answers)]
    length = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    targets = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
        targets[i, len(p) - 1: len(p) + len(a) - 1] = torch.tensor(a)  # position t predicts word t + 1
    return ids, mask, targets


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, images: np.ndarray, questions: list[str],
                   batch_size: int = 200) -> list[str]:
    """The model's greedy answer to each question (at most :data:`MAX_ANSWER_TOKENS` words, up to ``<eos>``; an
    answer without ``<eos>`` in that budget ends with ``" <no eos>"`` so it never counts as right; padding, ``<bos>``
    and the placeholders are never chosen). Questions of
    equal length are batched without padding: each step is one full forward pass of the grown sequences.

    Example:
        >>> greedy_answers(build_vlm().eval(), *shapes_vqa(2, seed=0)[:2])[0] in ("", "red")  # doctest: +SKIP
        False
    """
    out: list[str] = [""] * len(questions)
    groups: dict[int, list[int]] = {}
    for i, q in enumerate(questions):
        groups.setdefault(len(prompt_ids(q)), []).append(i)
    for idx in groups.values():
        for start in range(0, len(idx), batch_size):
            sel = idx[start: start + batch_size]
            ids = torch.tensor([prompt_ids(questions[i]) for i in sel])
            pixels = normalise(images[sel])
            for _ in range(MAX_ANSWER_TOKENS):
                logits = model(input_ids=ids, pixel_values=pixels).logits[:, -1].clone()
                # an answer is words and <eos>: a placeholder, padding or <bos> is never an answer word (an image
                # placeholder emitted would also ask the next step for an image the prompt does not hold)
                logits[:, [PAD_ID, BOS_ID, IMAGE_ID, ANSWER_ID]] = -torch.inf
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            n_prompt = ids.shape[1] - MAX_ANSWER_TOKENS
            for row, i in enumerate(sel):
                words = ids[row, n_prompt:].tolist()
                done = EOS_ID in words
                out[i] = decode(words[: words.index(EOS_ID)] if done else words) + ("" if done else " <no eos>")
    return out


def accuracy_by_type(model: torch.nn.Module, images: np.ndarray, questions: list[str], answers: list[str],
                     kinds: np.ndarray) -> dict[str, float]:
    """Exact-match accuracy of the greedy answers, overall (``"all"``) and per question type.

    Example:
        >>> sorted(accuracy_by_type(build_vlm().eval(), *[shapes_vqa(4, 0)[i] for i in (0, 1, 2, 4)]))
        ['all', 'colour', 'shape', 'where']
    """
    was = model.training
    model.eval()
    right = np.array([p == a for p, a in zip(greedy_answers(model, images, questions), answers)])
    model.train(was)
    acc = {"all": float(right.mean()) if right.size else float("nan")}
    for k, t in enumerate(QUESTION_TYPES):
        acc[t] = float(right[kinds == k].mean()) if (kinds == k).any() else float("nan")
    return acc


def token_labels(objects: dict, grid: int = 4, min_pixels: int = 12) -> np.ndarray:
    """Per image token (``grid`` x ``grid`` patches, row-major) the auxiliary labels: column 0 the colour of the
    object covering the patch most (1 + its :data:`COLOURS` index; 0 where no object covers ``min_pixels``), column 1
    its shape (1 circle, 2 cross, 0 none). Used only by the training's auxiliary loss (see :func:`train`).

    Example:
        >>> token_labels(shapes_vqa(2, seed=0, objects=True)[5]).shape
        (2, 16, 2)
    """
    masks = objects["masks"]
    n, _, size, _ = masks.shape
    p = size // grid
    cover = masks.reshape(n, 2, grid, p, grid, p).sum(axis=(3, 5)).reshape(n, 2, grid * grid)
    top = cover.argmax(axis=1)  # (n, tokens): the object covering most
    present = cover.max(axis=1) >= min_pixels
    colour = np.take_along_axis(objects["colour"], top, axis=1) + 1
    return np.stack([np.where(present, colour, 0), np.where(present, top + 1, 0)], axis=-1).astype(np.int64)


def card_texts() -> dict[str, str]:
    """The card's descriptions of the model, its prompt and its loss (one place, so a card's text can be checked
    against the code that trained it).

    Example:
        >>> sorted(card_texts())
        ['command', 'description', 'loss', 'prompt']
    """
    return {
        "command": "python -m vitcam_nb.data.train_vlm  (CPU, one thread; writes vitcam_nb/data/models/shapes-vlm.*)",
        "description": "tiny LLaVA (transformers LlavaForConditionalGeneration: a 4-layer CLIP vision tower of width "
                       "64 on 64x64 images with 16x16 patches (a 4x4 grid of image tokens), LLaVA's MLP projector "
                       "reading the tower's layer -2 without its class token, a 3-layer Llama decoder of width 64 "
                       f"over a {len(VOCAB)}-word vocabulary, the image tokens before the question), trained from "
                       "random init with teacher forcing on the answer words (and an auxiliary image-token loss, "
                       "see training.loss). The mask of the object a question asks about is the known answer of a "
                       "map of the answer.",
        "prompt": f"<bos> + {IMAGE_TOKENS} x <image> (expanded: one per 16x16 patch, row-major, the tower's class "
                  "token dropped) + the question's words (no '?'); the last word's logits give the answer's first "
                  "word; the answer's words and <eos> follow",
        "loss": "cross-entropy of the answer words and <eos> under teacher forcing (prompt positions carry no loss) "
                "+ aux_weight x (cross-entropy of a linear head on the projector's output predicting each image "
                "token's colour (5 classes, none included), shape (3) and quadrant (4); labels from token_labels, "
                "the head is not saved); history's train_loss is that sum",
    }


def _pool(cfg: dict) -> tuple[np.ndarray, list[str], list[str], np.ndarray]:
    """The training pool: ``cfg["pool"]`` images in chunks of 512, chunk c from seed ``train_seed + c``, with the
    image tokens' auxiliary labels (:func:`token_labels`)."""
    images, questions, answers, labels = [], [], [], []
    for c, start in enumerate(range(0, cfg["pool"], 512)):
        im, q, a, _, _, obj = shapes_vqa(min(512, cfg["pool"] - start), seed=cfg["train_seed"] + c, objects=True)
        images.append(im)
        questions += q
        answers += a
        labels.append(token_labels(obj))
    return np.concatenate(images), questions, answers, np.concatenate(labels)


def train(out: str | Path = MODELS_DIR, log=print, **overrides) -> dict:
    """Train ``shapes-vlm`` and write its safetensors weights and JSON card to ``out``; returns the card.

    Example:
        >>> card = train(out="/tmp/vitcam_models", steps=2, pool=64, n_test=8)  # doctest: +SKIP
    """
    unknown = sorted(set(overrides) - set(TRAIN))
    if unknown:
        raise ArgumentError(f"overrides: unknown training settings {unknown}; known: {sorted(TRAIN)}")
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(dict(TRAIN, **overrides), Path(out), log)
    finally:  # process settings of the caller's: restored
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _train(cfg: dict, out: Path, log) -> dict:
    import transformers

    torch.set_num_threads(1)
    t0 = time.time()
    images, questions, answers, labels = _pool(cfg)
    test_images, test_q, test_a, _, test_kinds = shapes_vqa(cfg["n_test"], seed=cfg["test_seed"])
    log(f"[{NAME}] pool of {len(images)} training and {cfg['n_test']} test questions ({time.time() - t0:.0f}s)")
    torch.manual_seed(cfg["train_seed"])
    model = build_vlm()
    model.train()
    # the auxiliary head: image-token colour (5), shape (3) and quadrant (4) from what the LM reads (the projector's
    # output); it gives the tower and projector a dense signal from the first step and is not part of the saved model
    aux = torch.nn.Linear(int(CONFIG["text_config"]["hidden_size"]), 12)
    quadrant = torch.tensor([(r // 2) * 2 + c // 2 for r in range(4) for c in range(4)])
    kept = {}
    model.model.multi_modal_projector.register_forward_hook(lambda _m, _i, o: kept.__setitem__("img", o))
    groups = [{"params": [p], "weight_decay": cfg["weight_decay"] if p.ndim > 1 and "embed" not in n else 0.0}
              for n, p in [*model.named_parameters(), *(("aux." + n, p) for n, p in aux.named_parameters())]]
    opt = torch.optim.AdamW(groups, lr=cfg["lr"])
    order = np.random.default_rng(cfg["train_seed"])
    perm, pos = order.permutation(len(images)), 0
    total, running, history = cfg["steps"], 0.0, []
    t1 = time.time()
    for step in range(total):
        if pos + cfg["batch_size"] > len(perm):
            perm, pos = order.permutation(len(images)), 0
        sel = np.sort(perm[pos: pos + cfg["batch_size"]])
        pos += cfg["batch_size"]
        ids, mask, targets = teacher_forcing_batch([questions[i] for i in sel], [answers[i] for i in sel])
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, total, cfg)
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=normalise(images[sel])).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        if cfg["aux_weight"]:
            head, lab = aux(kept["img"]), torch.from_numpy(labels[sel])
            loss = loss + cfg["aux_weight"] * (
                F.cross_entropy(head[..., :5].reshape(-1, 5), lab[..., 0].reshape(-1))
                + F.cross_entropy(head[..., 5:8].reshape(-1, 3), lab[..., 1].reshape(-1))
                + F.cross_entropy(head[..., 8:].reshape(-1, 4), quadrant.repeat(len(sel))))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *aux.parameters()], cfg["grad_clip"])
        opt.step()
        running += loss.item()
        if (step + 1) % cfg["log_every"] == 0 or step + 1 == total:
            acc = accuracy_by_type(model, test_images[:200], test_q[:200], test_a[:200], test_kinds[:200])
            n = (step % cfg["log_every"]) + 1
            history.append({"step": step + 1, "train_loss": round(running / n, 5),
                            **{f"test200_{k}": round(v, 4) for k, v in acc.items()}})
            running = 0.0
            log(f"[{NAME}] step {step + 1}/{total} {history[-1]} ({time.time() - t1:.0f}s)")
    seconds = time.time() - t0
    model.eval()
    acc = accuracy_by_type(model, test_images, test_q, test_a, test_kinds)
    counts = {t: int((test_kinds == k).sum()) for k, t in enumerate(QUESTION_TYPES)}
    card = {
        "name": NAME,
        "task": "visual question answering about a circle and a cross in named colours (colour, where, shape); "
                "the asked-about object's mask known",
        "description": card_texts()["description"],
        "classes": list(VOCAB),
        "hf_class": HF_CLASS,
        "hf_config": CONFIG,
        "attn_implementation": "eager",
        "vocabulary": {"words": list(VOCAB), "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
                       "image_id": IMAGE_ID, "image_tokens": IMAGE_TOKENS,
                       "answer_id": ANSWER_ID,
                       "prompt": card_texts()["prompt"],
                       "code": "vitcam_nb.data.shapes_vlm: prompt_ids, answer_ids, encode, decode"},
        "vision_feature_layer": CONFIG["vision_feature_layer"],
        "vision_feature_select_strategy": CONFIG["vision_feature_select_strategy"],
        "unread_tower_layers": "the tower's last layer (index 3) and post_layernorm: the projector reads "
                               "hidden_states[-2], the output of layer 2; they keep their random init",
        "pretrained_cfg": {"architecture": "llava_shapes", "tag": NAME, "hf_hub_id": None, "url": None,
                           "source": "vitcam_nb bundled", "input_size": [3, 64, 64], "mean": list(MEAN),
                           "std": list(STD), "label_names": list(VOCAB), "license": "MIT"},
        "preprocessing": "uint8 RGB (64, 64, 3) -> x / 255 -> (x - mean) / std with CLIP's mean and std "
                         "(vitcam_nb.data.train_vlm.normalise), no resize",
        "mean": list(MEAN), "std": list(STD),
        "data": {"generator": "vitcam_nb.data.shapes_vlm.shapes_vqa(n, seed)",
                 "generator_settings": vqa_generator_settings(),
                 "train_seeds": f"a pool of {cfg['pool']} questions, chunk c of 512 from seed {cfg['train_seed']} + c",
                 "test_seed": cfg["test_seed"], "n_test": cfg["n_test"], "n_test_per_type": counts},
        "test_accuracy": acc["all"],
        "test_accuracy_per_type": {t: acc[t] for t in QUESTION_TYPES},
        "chance_accuracy_per_type": chance_levels(),
        "answer_rule": f"greedy, at most {MAX_ANSWER_TOKENS} tokens, up to <eos>; right iff the words before <eos> "
                       "equal the answer (vitcam_nb.data.train_vlm.greedy_answers)",
        "training": {"optimizer": "AdamW (betas 0.9, 0.999; no weight decay on biases, norms, embeddings)",
                     "schedule": "linear warmup then cosine decay to min_lr, per step",
                     "init": "transformers' LLaVA/CLIP/Llama init (torch seed train_seed); every part trained "
                             "at the same learning rate",
                     "loss": card_texts()["loss"], "command": card_texts()["command"],
                     **cfg, "seconds": round(seconds, 1),
                     "seconds_training_steps": round(time.time() - t1, 1),
                     "threads": torch.get_num_threads(), "history": history},
        "versions": library_versions(transformers),
    }
    weights_path = write_bundled(model, card, out, NAME)
    log(f"[{NAME}] test {acc} (chance {chance_levels()}); wrote {weights_path} ({seconds:.0f}s)")
    return card


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--out", "/tmp/vitcam_models", "--steps", "2"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(MODELS_DIR))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    args = parser.parse_args(argv)
    train(args.out, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr)) if v is not None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
