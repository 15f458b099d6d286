"""The lxt peer of ``benchmarks/items/rules.py``: lxt's efficient LRP on torchvision's ViT, run by another
interpreter (a virtual environment where lxt imports: lxt 2.1 needs transformers < 5).

Run as a script file with that interpreter, never as a module of this tree; it imports nothing from vitcam_nb or
``benchmarks``, only torch, torchvision, safetensors and lxt::

    /work/venvs/lxt/bin/python benchmarks/rules_peer.py --weights /tmp/w.safetensors --rounds 3

``--weights`` is the safetensors file the rules item writes: a timm ``VisionTransformer``'s state dict, the
normalised input (``__input__``) and, as metadata, the geometry and the target class. The same weights go into
torchvision's ``VisionTransformer`` (names mapped one to one; both use LayerNorm eps 1e-6 and exact GELU), which is
patched with lxt's default map for it (``lxt.efficient.models.vit_torch.cp_LRP``: LayerNorm std and GELU by the
identity rule, no gradient into the softmax: CP-LRP, the same substitutions as vitcam_nb's ``cp_lrp``). One
measurement is lxt's recipe: a forward pass, ``logit[target].backward()``, and the relevance read at the hidden
state entering the first encoder block (input x gradient, summed over channels, per token, class token first).
It prints one JSON line: the seconds of each round, the relevance, the logits' first entries, the versions.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:  # nothing next to this file shadows a package
    del sys.path[0]

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402


def torchvision_state(timm_state: dict, depth: int) -> dict:
    """timm ViT names -> torchvision ViT names (the tensors themselves unchanged)."""
    out = {"conv_proj.weight": timm_state["patch_embed.proj.weight"],
           "conv_proj.bias": timm_state["patch_embed.proj.bias"],
           "class_token": timm_state["cls_token"], "encoder.pos_embedding": timm_state["pos_embed"],
           "encoder.ln.weight": timm_state["norm.weight"], "encoder.ln.bias": timm_state["norm.bias"],
           "heads.head.weight": timm_state["head.weight"], "heads.head.bias": timm_state["head.bias"]}
    pairs = {"ln_1": "norm1", "self_attention.out_proj": "attn.proj", "ln_2": "norm2", "mlp.0": "mlp.fc1",
             "mlp.3": "mlp.fc2"}
    for i in range(depth):
        tv, tm = f"encoder.layers.encoder_layer_{i}.", f"blocks.{i}."
        for a, b in pairs.items():
            for p in ("weight", "bias"):
                out[f"{tv}{a}.{p}"] = timm_state[f"{tm}{b}.{p}"]
        out[f"{tv}self_attention.in_proj_weight"] = timm_state[f"{tm}attn.qkv.weight"]
        out[f"{tv}self_attention.in_proj_bias"] = timm_state[f"{tm}attn.qkv.bias"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()

    import safetensors
    import torch
    import torchvision
    from lxt.efficient import monkey_patch
    from safetensors.torch import load_file
    from torchvision.models import vision_transformer

    if args.threads:
        torch.set_num_threads(args.threads)
    with safetensors.safe_open(args.weights, "pt") as f:
        meta = json.loads(f.metadata()["geometry"])
    state = load_file(args.weights)
    x = state.pop("__input__")
    monkey_patch(vision_transformer)  # lxt's default map for torchvision's ViT (cp_LRP)
    model = vision_transformer.VisionTransformer(
        image_size=meta["img_size"], patch_size=meta["patch_size"], num_layers=meta["depth"],
        num_heads=meta["num_heads"], hidden_dim=meta["embed_dim"], mlp_dim=meta["mlp_dim"],
        num_classes=meta["num_classes"])
    model.load_state_dict(torchvision_state(state, meta["depth"]), strict=True)
    model.eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    kept = {}

    def keep(_module, args):
        h = args[0]
        h.retain_grad()
        kept["h"] = h

    model.encoder.layers[0].register_forward_pre_hook(keep)

    def once():
        inp = x.clone().requires_grad_(True)
        logits = model(inp)
        logits[0, meta["target"]].backward()
        return logits

    once()  # warm-up
    samples = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        logits = once()
        samples.append(time.perf_counter() - t0)
    relevance = (kept["h"] * kept["h"].grad).sum(-1)[0]
    print(json.dumps({"samples_s": samples, "relevance": relevance.double().tolist(),
                      "logits_head": logits[0, :5].double().tolist(), "threads": torch.get_num_threads(),
                      "versions": {"lxt": importlib.metadata.version("lxt"),
                                   "transformers": importlib.metadata.version("transformers"),
                                   "torch": torch.__version__, "torchvision": torchvision.__version__,
                                   "safetensors": safetensors.__version__,
                                   "python": sys.version.split()[0]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
