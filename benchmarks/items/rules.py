"""Backward rules' cost (issue #34, item 6): ``vc.trace(model, x, rule=r)`` against the plain trace of the same sites
(``rule="gradient"``) in the same run, rounds interleaved, for every rule; target: rule / plain <= 1.3.

Run:  ``python -m benchmarks --items rules`` or ``python -m benchmarks.items.rules [--rounds N] [--out FILE]``
(writes ``benchmarks/RULES.json``; ``--quick``: the tiny ViT, one round, no claims, written under
``benchmarks/results/``). The model is timm's ``vit_base_patch16_224`` with random weights (timing does not depend on
the weights), the input a seeded ``randn`` image, the target the top-1 logit. Two site sets are timed: ``resid_pre``
alone (what the rule presets read: the smallest trace, where a rule's overhead shows most) and the default sites
F1..F6 plus ``resid_pre``.

Peer (``--peer-python PATH`` or the environment variable ``VITCAM_PEER_PYTHON``): lxt, AttnLRP's official package,
run by that interpreter in a subprocess (``benchmarks/rules_peer.py``; lxt 2.1 needs transformers < 5, so it lives in
its own virtual environment, e.g. ``python -m venv /work/venvs/lxt && /work/venvs/lxt/bin/pip install lxt
"transformers<5" timm torch safetensors``). The item writes the same model's weights and input to a safetensors
file (no pickle); the peer loads them into torchvision's ViT, which lxt patches (its ViT support:
``lxt.efficient.models.vit_torch.cp_LRP``, i.e. CP-LRP), and returns its seconds per forward + backward and its
input relevance at the first block's input. Recorded: the ratio kit ``vc.trace(rule="cp_lrp", sites=["resid_pre"],
layers=[0])`` / lxt, and how the relevance maps agree (kit cp_lrp, the same rule: max relative difference and
correlation; kit attnlrp, another rule: correlation). Without an interpreter the peer is recorded as not
measured. Chefer et al.'s code is a repository with its own ViT definition and no package on PyPI
(``pip download transformer-explainability`` finds none), so it is recorded as not measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks import workloads
from benchmarks.machine import machine_info, versions
from benchmarks.timing import interleave, paired_ratio

PEER_ENV = "VITCAM_PEER_PYTHON"
PEER_SCRIPT = Path(__file__).resolve().parent.parent / "rules_peer.py"

TARGET = 1.3
ROOT = Path(__file__).resolve().parent.parent
SITE_SETS = {"resid_pre": ["resid_pre"], "F1..F6+resid_pre": ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre"]}
CHEFER = ("not measured: Chefer et al.'s Transformer-Explainability (github.com/hila-chefer/Transformer-Explainability)"
          " is not a package (no distribution named transformer-explainability on PyPI); it runs its own ViT definition"
          " (baselines/ViT/ViT_LRP.py), not a timm model")


def lxt_status() -> str:
    """Whether lxt's efficient AttnLRP (``lxt.efficient``) imports here; the reason when it does not.

    Example:
        >>> lxt_status().startswith("lxt")
        True
    """
    try:
        import lxt.efficient  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "lxt":
            return ("lxt: not installed (lxt 2.1 from PyPI was checked unpacked: lxt.efficient imports "
                    "transformers.modeling_attn_mask_utils, which the installed transformers does not have, so "
                    "it does not import cleanly and was not installed)")
        return f"lxt: installed but does not import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # an installed lxt that fails on import is reported, never fatal
        return f"lxt: installed but does not import ({type(exc).__name__}: {exc})"
    return "lxt: importable, but no timm ViT patch map ships with it (lxt.efficient.models: torchvision ViT, HF LMs)"


def _write_peer_file(w: workloads.Workload, target: int, folder: str) -> str:
    """The model's weights and input, and its geometry as metadata, in one safetensors file for the peer."""
    from safetensors.torch import save_file

    m = w.model
    blk = m.blocks[0]
    geometry = {"img_size": int(m.patch_embed.img_size[0]), "patch_size": int(m.patch_embed.patch_size[0]),
                "depth": len(m.blocks), "num_heads": int(blk.attn.num_heads), "embed_dim": int(m.embed_dim),
                "mlp_dim": int(blk.mlp.fc1.out_features), "num_classes": int(m.num_classes), "target": target}
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in m.state_dict().items()}
    tensors["__input__"] = w.x.detach().cpu().contiguous().clone()
    path = os.path.join(folder, "peer.safetensors")
    save_file(tensors, path, metadata={"geometry": json.dumps(geometry)})
    return path


def _agreement(kit, peer) -> dict:
    import numpy as np

    kit, peer = np.asarray(kit, np.float64), np.asarray(peer, np.float64)
    return {"max_abs_diff_over_max_abs": float(np.abs(kit - peer).max() / np.abs(peer).max()),
            "pearson_r": float(np.corrcoef(kit, peer)[0, 1])}


def lxt_peer(python: str | None, w: workloads.Workload, rounds: int) -> dict:
    """lxt's CP-LRP on torchvision's ViT with the same weights, input and target, in a subprocess run by ``python``,
    against the kit's ``cp_lrp`` trace of the smallest site set: seconds, ratio, and the relevance maps' agreement.

    Example:
        >>> lxt_peer(None, None, 1)["measured"]
        False
    """
    if not python:
        return {"measured": False, "why": f"{lxt_status()}; no peer interpreter given (--peer-python or "
                                          f"{PEER_ENV})"}
    import numpy as np

    import vitcam_nb as vc

    target = int(w.model(w.x).argmax())
    kw = {"targets": [target], "sites": ["resid_pre"], "layers": [0]}

    def kit(rule: str):
        return vc.trace(w.model, w.x.detach().cpu(), rule=rule, **kw)

    def relevance(tr) -> list[float]:
        h = tr["act"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
        g = tr["grad"].sel(site="resid_pre").isel(layer=0, target=0).values.astype(np.float64)
        return (h * g).sum(-1).tolist()

    import torch

    kit("cp_lrp")  # warm-up (the first trace hashes the weights)
    peer_runs, kit_samples = [], []
    with tempfile.TemporaryDirectory() as folder:
        cmd = [python, str(PEER_SCRIPT), "--weights", _write_peer_file(w, target, folder), "--rounds", str(rounds),
               "--threads", str(torch.get_num_threads())]
        for turn in ("peer", "kit", "peer"):  # the kit's rounds between the peer's two runs
            if turn == "kit":
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    kit("cp_lrp")
                    kit_samples.append(time.perf_counter() - t0)
                continue
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                return {"measured": False, "why": f"the peer exited {done.returncode}: {done.stderr[-2000:]}"}
            peer_runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    tr = kit("cp_lrp")
    peer_samples = [s for r in peer_runs for s in r["samples_s"]]
    kit_median, peer_median = float(np.median(kit_samples)), float(np.median(peer_samples))
    peer = peer_runs[-1]
    return {"measured": True, "peer": "lxt (efficient, default map for torchvision's ViT: cp_LRP) on torchvision "
                                      "VisionTransformer with the same weights, input and target",
            "target_class": target, "kit": "vc.trace(model, x, targets=[c], rule='cp_lrp', sites=['resid_pre'], "
                                            "layers=[0])",
            "kit_samples_s": kit_samples, "peer_samples_s": peer_samples, "kit_median_s": kit_median,
            "peer_median_s": peer_median, "ratio_kit_over_peer": kit_median / peer_median,
            "logits_max_abs_diff": float(np.abs(np.asarray(peer["logits_head"]) -
                                                tr["logits"].values[:5].astype(np.float64)).max()),
            "relevance_agreement": {"kit cp_lrp vs lxt (same rule)": _agreement(relevance(tr), peer["relevance"]),
                                    "kit attnlrp vs lxt (AttnLRP's uniform rules on q k^T and A V vs lxt's CP-LRP)":
                                        _agreement(relevance(kit("attnlrp")), peer["relevance"])},
            "peer_threads": peer["threads"], "peer_versions": peer["versions"],
            "note": "the kit's time is a whole trace (hooks, batched backward with the expected-logit target, the "
                    "xarray Dataset); the peer's a bare forward and backward"}


def run(rounds: int = 3, model: str = workloads.VIT_BASE, threads: int = 0, peer_python: str | None = None) -> dict:
    """Interleaved rounds of the plain trace and one trace per rule, for each site set; medians and ratios.

    Example:
        >>> run(rounds=1, model="tiny_vit")["rules"]   # doctest: +SKIP
        ['cp_lrp', 'attnlrp', 'libragrad']
    """
    import torch

    import vitcam_nb as vc
    from vitcam_nb.core.rules import rule_names

    if threads:
        torch.set_num_threads(threads)
    warnings.simplefilter("ignore", vc.DegenerateMapWarning)
    started = machine_info("cpu")
    w = workloads.build(model)
    x = w.x.detach().cpu()
    rules = [r for r in rule_names() if r != "gradient"]
    out: dict = {"model": model, "description": w.description, "target_class": "top1", "rules": rules,
                 "rounds": rounds, "site_sets": {}}
    for label, sites in SITE_SETS.items():
        kw = {"sites": sites}
        candidates = {r: (lambda r=r, kw=kw: vc.trace(w.model, x, targets="top1", rule=r, **kw))
                      for r in ["gradient", *rules]}
        for fn in candidates.values():  # warm-up (the first trace hashes the weights)
            fn()
        samples = interleave(candidates, rounds)
        rows = {r: samples.stats(r) for r in candidates}
        for r in rules:
            ratio = paired_ratio(samples[r], samples["gradient"])
            rows[r].update(ratio_vs_plain=ratio, cpu_ratio_vs_plain=rows[r]["cpu_median_s"] /
                           rows["gradient"]["cpu_median_s"], holds=bool(ratio <= TARGET))
        out["site_sets"][label] = {"sites": kw["sites"], "timings": rows}
    out.update(target=f"rule trace / plain trace of the same sites <= {TARGET}", lxt=lxt_status(), chefer=CHEFER,
               lxt_peer=lxt_peer(peer_python, w, rounds),
               holds=all(row["holds"] for s in out["site_sets"].values() for r, row in s["timings"].items()
                         if r != "gradient"),
               machine=started, load_average_end=list(os.getloadavg()), versions=versions(),
               date=_dt.date.today().isoformat(),
               note="one run on a shared CPU (read the ratios, measured side by side, not the absolute times)")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: measure, print the JSON and write it to ``--out``.

    Example:
        >>> main(["--quick", "--out", "/tmp/rules.json"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.items.rules", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=workloads.VIT_BASE)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="tiny ViT, one round, no claims")
    p.add_argument("--peer-python", default=os.environ.get(PEER_ENV), help="an interpreter where lxt imports (default: "
                   f"${PEER_ENV}); without one the peer is recorded as not measured")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/RULES.json (quick: "
                   "benchmarks/results/rules-quick.json)")
    args = p.parse_args(argv)
    out = args.out or (ROOT / "results" / "rules-quick.json" if args.quick else ROOT / "RULES.json")
    result = run(1 if args.quick else args.rounds, workloads.TINY if args.quick else args.model, args.threads,
                 args.peer_python)
    result["command"] = "python -m benchmarks.items.rules " + " ".join(sys.argv[1:] if argv is None else argv)
    result["quick"] = bool(args.quick)
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
