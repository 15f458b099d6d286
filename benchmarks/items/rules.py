"""Backward rules' cost (issue #34, item 6): ``vc.trace(model, x, rule=r)`` against the plain trace of the same sites
(``rule="gradient"``) in the same run, rounds interleaved, for every rule; target: rule / plain <= 1.3.

Run:  ``python -m benchmarks --items rules`` or ``python -m benchmarks.items.rules [--rounds N] [--out FILE]``
(writes ``benchmarks/RULES.json``; ``--quick``: the tiny ViT, one round, no claims, written under
``benchmarks/results/``). The model is timm's ``vit_base_patch16_224`` with random weights (timing does not depend on
the weights), the input a seeded ``randn`` image, the target the top-1 logit. Two site sets are timed: ``resid_pre``
alone (what the rule presets read: the smallest trace, where a rule's overhead shows most) and the default sites
F1..F6 plus ``resid_pre``. Peers: lxt (AttnLRP's official package) is timed only when it imports with the installed
packages; Chefer et al.'s code is a repository with its own ViT definition, not a package that runs on a timm model,
so it is recorded as not measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import warnings
from pathlib import Path

from benchmarks import workloads
from benchmarks.machine import machine_info, versions
from benchmarks.timing import interleave, paired_ratio

TARGET = 1.3
ROOT = Path(__file__).resolve().parent.parent
SITE_SETS = {"resid_pre": ["resid_pre"], "F1..F6+resid_pre": ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre"]}
CHEFER = ("not measured: Chefer et al.'s Transformer-Explainability (github.com/hila-chefer/Transformer-Explainability)"
          " is not a package; it runs its own ViT definition (baselines/ViT/ViT_LRP.py), not a timm model")


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


def run(rounds: int = 3, model: str = workloads.VIT_BASE, threads: int = 0) -> dict:
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
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/RULES.json (quick: "
                   "benchmarks/results/rules-quick.json)")
    args = p.parse_args(argv)
    out = args.out or (ROOT / "results" / "rules-quick.json" if args.quick else ROOT / "RULES.json")
    result = run(1 if args.quick else args.rounds, workloads.TINY if args.quick else args.model, args.threads)
    result["command"] = "python -m benchmarks.items.rules " + " ".join(sys.argv[1:] if argv is None else argv)
    result["quick"] = bool(args.quick)
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
