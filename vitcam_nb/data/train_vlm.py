"""Train the bundled known-answer VLM ``shapes-vlm`` on :func:`~vitcam_nb.data.shapes_vlm.shapes_vqa` (CPU, one
thread, seeded).

Usage::

    python -m vitcam_nb.data.train_vlm            # writes shapes-vlm.safetensors and shapes-vlm.json

The model is a transformers ``LlavaForConditionalGeneration`` built from a tiny config (random init): a CLIP vision
tower (4 layers, width 64, 8x8 patches on 64x64 images), LLaVA's two-layer MLP projector reading the tower's
second-to-last layer without its class token (``vision_feature_layer=-2``, ``vision_feature_select_strategy=
"default"``, as LLaVA-1.5), and a small Llama decoder over the word vocabulary of :mod:`vitcam_nb.data.shapes_vlm`.
The loss is the cross-entropy of the answer's words and ``<eos>`` under teacher forcing (the prompt's positions carry
no loss). The training images come from a fixed pool drawn once from ``train_seed`` (rendering is slower than a step
here); the test accuracy (greedy answers, per question type) uses a seed never used in training. Runs are
deterministic for a given torch build (one thread, deterministic algorithms).
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
from vitcam_nb.core.provenance import file_sha256
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
                      "num_hidden_layers": 4, "num_attention_heads": 4, "image_size": 64, "patch_size": 8,
                      "num_channels": 3, "hidden_act": "gelu", "layer_norm_eps": 1e-6, "attention_dropout": 0.0},
    "text_config": {"model_type": "llama", "vocab_size": len(VOCAB), "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "max_position_embeddings": 128, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID,
                    "eos_token_id": EOS_ID, "tie_word_embeddings": False, "attention_dropout": 0.0},
    "image_token_index": IMAGE_ID, "image_seq_length": IMAGE_TOKENS, "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "tie_word_embeddings": False,
}
TRAIN: dict = {"steps": 900, "batch_size": 32, "lr": 1e-3, "tower_lr_mult": 1.0, "min_lr": 1e-5,
               "weight_decay": 0.01, "warmup_steps": 50, "grad_clip": 1.0, "pool": 8000, "n_test": 600,
               "log_every": 150, "train_seed": 30_000, "test_seed": 90_030, "init_from": "shapes-vit"}


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


def _from_shapes_vit(model: torch.nn.Module, weights: Path) -> dict:
    """Start the CLIP tower from the bundled classifier ``shapes-vit`` (a timm ViT of the same width, heads, MLP and
    patch size, trained on single shapes): patch embedding (its bias folded into the patch positions, CLIP's patch
    convolution has none), class token, positions, and the first blocks (timm's fused qkv split into q, k, v). CLIP
    normalises the embeddings (``pre_layrnorm``) where timm does not: it starts with weight = the mean per-token
    standard deviation of the embeddings on shapes images and bias 0, so the residual stream keeps about its scale;
    the copy is therefore a start, not the classifier (every pre-norm consumer removes the per-token mean anyway)."""
    from safetensors.torch import load_file

    from vitcam_nb.data.shapes import shapes

    src, tower = load_file(str(weights)), model.model.vision_tower
    d, state = int(src["cls_token"].shape[-1]), tower.state_dict()
    state["embeddings.patch_embedding.weight"] = src["patch_embed.proj.weight"]
    state["embeddings.class_embedding"] = src["cls_token"].reshape(d)
    pos = src["pos_embed"][0].clone()
    pos[1:] += src["patch_embed.proj.bias"]
    state["embeddings.position_embedding.weight"] = pos
    for i in range(int(model.config.vision_config.num_hidden_layers)):
        cl, tb = f"encoder.layers.{i}.", f"blocks.{i}."
        for a, b in (("layer_norm1", "norm1"), ("layer_norm2", "norm2"), ("self_attn.out_proj", "attn.proj"),
                     ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
            for p in ("weight", "bias"):
                state[f"{cl}{a}.{p}"] = src[f"{tb}{b}.{p}"]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            for p in ("weight", "bias"):
                state[f"{cl}self_attn.{name}.{p}"] = src[f"{tb}attn.qkv.{p}"][j * d:(j + 1) * d]
    tower.load_state_dict(state)
    with torch.no_grad():
        emb = tower.embeddings(normalise(shapes(64, seed=0)[0]))
        tower.pre_layrnorm.weight.fill_(float(emb.std(-1).mean()))
        tower.pre_layrnorm.bias.zero_()
    return {"name": weights.stem, "weights_sha256": file_sha256(weights),
            "copied": "patch embedding (bias folded into positions), class token, positions, blocks 0-3",
            "pre_layrnorm": "weight = mean per-token std of the embeddings of shapes(64, seed=0), bias = 0"}


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


def _pool(cfg: dict) -> tuple[np.ndarray, list[str], list[str]]:
    """The training pool: ``cfg["pool"]`` images in chunks of 512, chunk c from seed ``train_seed + c``."""
    images, questions, answers = [], [], []
    for c, start in enumerate(range(0, cfg["pool"], 512)):
        im, q, a, _, _ = shapes_vqa(min(512, cfg["pool"] - start), seed=cfg["train_seed"] + c)
        images.append(im)
        questions += q
        answers += a
    return np.concatenate(images), questions, answers


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
    images, questions, answers = _pool(cfg)
    test_images, test_q, test_a, _, test_kinds = shapes_vqa(cfg["n_test"], seed=cfg["test_seed"])
    log(f"[{NAME}] pool of {len(images)} training and {cfg['n_test']} test questions ({time.time() - t0:.0f}s)")
    torch.manual_seed(cfg["train_seed"])
    model = build_vlm()
    init_from = _from_shapes_vit(model, MODELS_DIR / f"{cfg['init_from']}.safetensors") if cfg["init_from"] else None
    model.train()
    groups = []
    for n, p in model.named_parameters():
        copied = init_from is not None and n.startswith("model.vision_tower.")
        groups.append({"params": [p], "weight_decay": cfg["weight_decay"] if p.ndim > 1 and "embed" not in n else 0.0,
                       "lr_mult": cfg["tower_lr_mult"] if copied else 1.0})
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
            group["lr"] = learning_rate(step, total, cfg) * group["lr_mult"]
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=normalise(images[sel])).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
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
        "description": "tiny LLaVA (transformers LlavaForConditionalGeneration: a 4-layer CLIP vision tower of width "
                       "64 on 64x64 images with 8x8 patches, LLaVA's MLP projector reading the tower's layer -2 "
                       f"without its class token, a 2-layer Llama decoder of width 64 over a {len(VOCAB)}-word "
                       "vocabulary, the question before the image), tower started from shapes-vit, trained with "
                       "teacher forcing on the answer words. The mask of the object a question asks about is the "
                       "known answer of a map of the answer.",
        "classes": list(VOCAB),
        "hf_class": HF_CLASS,
        "hf_config": CONFIG,
        "attn_implementation": "eager",
        "vocabulary": {"words": list(VOCAB), "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
                       "image_id": IMAGE_ID, "image_tokens": IMAGE_TOKENS,
                       "answer_id": ANSWER_ID,
                       "prompt": "<bos> + the question's words + 64 x <image> (expanded: one per 8x8 patch, row-major, "
                                 "the tower's class token dropped) + <answer>; the answer's words and <eos> follow",
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
                     "init": "transformers' LLaVA/CLIP/Llama init (torch seed train_seed), then the CLIP tower "
                             "copied from init_from (see init_from)",
                     "tower": "the vision tower (copied from init_from) learns at tower_lr_mult x lr",
                     "loss": "cross-entropy of the answer words and <eos> under teacher forcing; prompt positions "
                             "carry no loss",
                     **cfg, "init_from": init_from, "seconds": round(seconds, 1),
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
