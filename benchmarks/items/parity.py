"""How each preset was checked (issue #53): every preset and backward rule against its authors' code where that
code installs from the package index, and otherwise against the reference a test writes from the paper's or the
code's equations independently of the kit; both measured here.

Run:  ``python -m benchmarks --items parity`` or ``python -m benchmarks.items.parity [--out FILE] [--quick]``.
It writes ``benchmarks/PARITY.json`` and the table of ``docs/presets.md`` between ``<!-- parity:start -->`` and
``<!-- parity:end -->`` (``--quick``: the JSON under ``benchmarks/results/`` only, docs untouched). The measured
rows come from the functions the parity tests assert on (``tests/unit/compute/parity_cases.py``): the same
models (tiny, random, built in code), inputs and reference calls. A reference package that is not installed gives
the row "not installed" (CI installs them: the [test] extra and ``.ci/run``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["MEASURED", "REFERENCED", "markdown", "measure", "run", "with_table"]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "presets.md"
OUT = ROOT / "benchmarks" / "PARITY.json"
START, END = "<!-- parity:start -->", "<!-- parity:end -->"

_CHEFER_NAN = ("Chefer's code min-max normalises an all-negative (after ReLU: all-zero) map to NaN; the kit returns "
               "zeros with a DegenerateMapWarning")

_FULLGRAD = ("libragrad(biases=True) is the column LibraGrad's code labels FullGrad+ (bias terms included), not its "
             "plain FullGrad (Pearson 0.83-0.90 between them)")

#: the families other than timm ViT the rules are measured on (test_rules.py, test_rules_families.py)
_RULE_FAMILIES = ("deit_distilled_layerscale", "dinov2_registers", "beit", "eva", "open_clip", "hf_vit", "hf_deit",
                  "hf_dinov2", "hf_dinov2_registers", "hf_clip", "hf_siglip")

#: (presets, case name in parity_cases, its arguments, deliberate differences in one sentence)
MEASURED: list[tuple[str, str, tuple, str]] = [
    ("legrad", "legrad_vs_legrad_torch", (-2,),
     "none: same read-out (ln_post of the mean over all tokens, then proj) and the same default blocks "
     "(layer_index=-2: the last two); the official blocks not hooked by the wrapper are run sequence-first as "
     "open_clip <= 2.23 ran them"),
    ("legrad", "legrad_vs_torchcam", ((-2, -1),),
     "none: torchcam averages the per-block maps where the kit sums them (equal after min-max); torchcam adds "
     "1e-8 to the maximum when it normalises"),
    ("legrad_cls", "legrad_vs_legrad_torch", (-2, (-2, -1), "model"),
     "deliberate: the kit's variant reads each block by the class token (the model's own pooling), not the "
     "official mean over all tokens; the row shows how far that is from the official map"),
    ("cp_lrp", "cp_lrp_vs_lxt", (),
     "read at the first block's input (patch + position embedding); lxt's own ViT example also applies zennit's "
     "Gamma rules to Linear and Conv2d layers and reads relevance at the pixels, which the kit does not"),
    ("shapley_patches (vc.evaluate)", "shapley_vs_shapiq", ((2, 4), 2), "none"),
    ("grad_sam", "published_vs_test_reference", ("grad_sam",), "none"),
    ("attcat", "published_vs_test_reference", ("attcat",), "none"),
    ("agcam", "published_vs_test_reference", ("agcam",), "none"),
    ("tokentm", "tokentm_vs_test_reference", (),
     "the CLS row of the final matrix is the kit's reading (how the code reads it was not checked)"),
    *[(("pytorch_grad_cam_vit, gradcam" if m == "gradcam" else m), "pgc_vs_kit", (m,),
       "EigenCAM's sign: pytorch-grad-cam keeps LAPACK's, the kit fixes it (the closer sign is compared)"
       if m.startswith("eigen") else "none (cv2 against torch bilinear resize: both half-pixel centres)")
      for m in ("gradcam", "hirescam", "gradcam_elementwise", "gradcampp", "xgradcam", "layercam", "eigencam",
                "eigengradcam")],

("chefer_attention_gradcam", "flat_vs_equations", ("chefer_attention_gradcam",), _CHEFER_NAN),
    ("attention_rollout", "flat_vs_equations", ("attention_rollout",), "none"),
    ("gradient_rollout", "flat_vs_equations", ("gradient_rollout",), "none"),
    ("legrad_style", "flat_vs_equations", ("legrad_style",),
     "deliberate: the kit's LeGrad-style map (exact LeGrad is legrad): query rows averaged before the ReLU, one "
     "target for every block"),
    ("transition_attention_maps", "presets_published_vs_test_reference", ("transition_attention_maps",), "none"),
    ("beyond_intuition_head", "presets_published_vs_test_reference", ("beyond_intuition_head",), "none"),
    ("beyond_intuition_token", "presets_published_vs_test_reference", ("beyond_intuition_token",),
     "blk.attn.vproj (from a patched model file not published) read as the values of all heads times the output "
     "projection's weight"),
    ("vit_cx", "presets_published_vs_test_reference", ("vit_cx",),
     "the noise is drawn from a seeded generator (the official code draws it unseeded)"),
    ("albef_itm_gradcam", "presets_published_vs_test_reference", ("albef_itm_gradcam",),
     "none with text_tokens='cls'; the reference applies the notebook's equation to the trace's own cross-attention "
     "and gradient, so this row checks the equation, not the capture"),
    ("grad_eclip", "grad_eclip_vs_test_reference", ("grad_eclip",),
     "none: the code's single-head block (q, k after out_proj)"),
    ("grad_eclip_paper", "grad_eclip_vs_test_reference", ("grad_eclip_paper",),
     "deliberate: the paper's per-head formula, where the code uses a single head"),
    ("transformer_attribution (rule chefer_lrp)", "chefer_lrp_vs_test_reference", (),
     "the final LayerNorm's eps is the model's (Chefer's ViT_LRP.py builds its final norm with torch's default "
     "1e-5, its blocks' with 1e-6; timm uses 1e-6 for all); " + _CHEFER_NAN),
    ("attnlrp (rule)", "rule_vs_test_reference", ("attnlrp",),
     "none (lxt patches no ViT for AttnLRP: its rules are written out by hand)"),
    ("cp_lrp (rule)", "rule_vs_test_reference", ("cp_lrp",), "as the measured cp_lrp row"),
    ("libragrad (rule)", "rule_vs_test_reference", ("libragrad",), _FULLGRAD),
    *[("attnlrp, cp_lrp, libragrad (rules)", "rule_vs_test_reference", (("attnlrp", "cp_lrp", "libragrad"), f),
       "the three rules' gradients side by side; as the timm ViT rows") for f in _RULE_FAMILIES],
    ("scorecam (weighting)", "scored_vs_pgc", ("scorecam",),
     "none (cv2 against torch bilinear resize: both half-pixel centres)"),
    ("ablationcam (weighting)", "scored_vs_pgc", ("ablationcam",),
     "the norm's output made non-negative with a zero channel (as test_scored_parity.py), so pytorch-grad-cam's "
     "ViT ablation layer zeroes the channel rather than writing min - 1e7"),
]

#: (presets, reference: repository + file + commit read, the test that re-implements it, its tolerance,
#:  deliberate differences): checked by a test only, not measured by this run: the generative-VLM presets, for
#: which no authors' code reads a decoder-only VLM.
REFERENCED: list[tuple[str, str, str, str, str]] = [
    ("vlm_tower_gradcam", "Selvaraju et al. 2017's Grad-CAM equations on the tower block LLaVA's vision_feature_layer "
     "reads (no authors' code explains a VLM answer); a hand-written hook-and-autograd Grad-CAM on a tiny random "
     "LLaVA", "tests/unit/compute/test_vlm_presets.py", "rtol 1e-5 of the map's largest value",
     "site F6 (the block output the projector reads), not pytorch-grad-cam's norm1: a classifier never reads its "
     "last block's patch outputs, LLaVA reads all of them"),
    ("vlm_generic_attention", "Chefer, Gur & Wolf 2021, Generic Attention-model Explainability (ICCV), the "
     "self-attention update R <- R + mean_h (grad A * A)^+ R written by hand over every token of a tiny random "
     "LLaVA's LM (their code, hila-chefer/Transformer-MM-Explainability, reads LXMERT/VisualBERT/DETR, not a "
     "decoder-only LM)", "tests/unit/compute/test_vlm_presets.py", "rtol 1e-4 (one layer: equal to the rule; all "
     "layers: equal to the rule less its hand-computed cross-layer products)",
     "read at the row predicting the answer token over the image-token columns; over several layers first-order "
     "(sum of the layers' terms: the products through other tokens are dropped, the trace stores answer rows "
     "only); not normalised per layer"),
    ("tam", "xmed-lab/TAM tam.py @7c7df1d (TAM, least_squares, rank_guassian_filter, multimodal_process): a reference "
     "written from its equations in the test (the model's own logits, np.linalg.lstsq, the filter by loops) on a "
     "tiny random LLaVA; the authors' function itself, run once outside the kit on the same logits, gives "
     "floor(255 x the kit's map) once its round 0 takes each token's own id", "tests/unit/compute/test_tam.py",
     "atol 2e-5 on maps in [0, 1]; filter rtol 1e-12; least-squares scale 1e-5 of a brute-force grid",
     "one teacher-forced forward, not generate's rounds; prompt context = every text token after the image (no "
     "chat-template special ids); each context slot's map of its own token (the code's round 0 takes the greedy "
     "prediction for the first prompt token and, off by one, the prompt's last token for the first answer "
     "token); repeats by token id; least squares in closed form; a constant positive filter window keeps its "
     "value (NaN in the code); no uint8 rounding"),
]


def _cases() -> object:
    for path in (str(ROOT / "tests"), str(ROOT / "tests" / "unit" / "compute")):  # as pytest's pythonpath
        if path not in sys.path:
            sys.path.insert(0, path)
    import parity_cases

    return parity_cases


def measure(name: str, args: tuple) -> dict:
    """One measured row: the case's figures, or why it did not run."""
    import pytest

    cases = _cases()
    fn: Callable = getattr(cases, name)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case = fn(*args)
    except pytest.skip.Exception as exc:
        return {"status": "not installed", "note": str(exc)[:300]}
    return {"status": "ok", "reference": case.reference, "model": case.model, "input": case.input,
            "max_abs_diff": case.max_abs, "relative_diff": case.relative, "pearson": case.pearson,
            "shape": list(case.kit.shape),
            "seconds": round(time.perf_counter() - t0, 2)}


def run(quick: bool = False) -> dict:
    """Every measured row (the pytorch-grad-cam ones only for GradCAM with ``quick``) and the referenced rows."""
    measured = MEASURED if not quick else [r for r in MEASURED if r[1] != "pgc_vs_kit" or r[2] == ("gradcam",)]
    rows = []
    for presets, name, args, differences in measured:
        rows.append({"presets": presets, "case": name, "args": repr(args), "differences": differences,
                     **measure(name, args)})
    referenced = [{"presets": p, "reference": ref, "test": test, "tolerance": tol, "differences": diff}
                  for p, ref, test, tol, diff in REFERENCED]
    import torch

    return {"item": "parity", "date": _dt.date.today().isoformat(), "quick": quick,
            "command": "python -m benchmarks --items parity", "torch": torch.__version__,
            "measured": rows, "referenced": referenced}


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(result: dict) -> str:
    """The "How each preset was checked" table of ``docs/presets.md``."""
    out = [f"Measured by `{result['command']}` on {result['date']} (torch {result['torch']}); each figure is the "
           "kit's map against the reference's on the same weights and input (maps min-max normalised where the "
           "method normalises; raw maps where marked, raw relevance for `cp_lrp`, Shapley values for "
           "`shapley_patches`, every stored gradient for the `(rule)` rows), the difference relative to the largest "
           "reference value in brackets. Where no code of the authors installs from the package index, the "
           "reference is a test's re-implementation of the paper's or the code's equations, independent of the "
           "kit (its own hooks, NumPy or plain torch), named in the reference column with the file and commit it "
           "follows.", "",
           "| preset | reference | model | input | max \\|difference\\| (relative) | Pearson | "
           "deliberate differences |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["measured"]:
        if r["status"] != "ok":
            out.append(f"| `{_cell(r['presets'])}` | {_cell(r['case'])}: {r['status']} | | | | | "
                       f"{_cell(r['differences'])} |")
            continue
        out.append(f"| `{_cell(r['presets'])}` | {_cell(r['reference'])} | {_cell(r['model'])} | "
                   f"{_cell(r['input'])} | {r['max_abs_diff']:.1e} ({r['relative_diff']:.0e}) | {r['pearson']:.6f} | "
                   f"{_cell(r['differences'])} |")
    if not result["referenced"]:
        return "\n".join(out)
    out += ["", "Where no code of the authors installs from the package index, a test re-implements the paper's or "
            "the code's equations independently of the kit (its own hooks, NumPy or plain torch, on tiny random "
            "models) and asserts the tolerance given; the reference is the repository file (and commit) it follows.",
            "", "| preset | reference (repository, file, commit) | test | tolerance asserted | "
            "deliberate differences |", "| --- | --- | --- | --- | --- |"]
    for r in result["referenced"]:
        out.append(f"| `{_cell(r['presets'])}` | {_cell(r['reference'])} | {_cell(r['test'])} | "
                   f"{_cell(r['tolerance'])} | {_cell(r['differences'])} |")
    return "\n".join(out)


def with_table(text: str, table: str) -> str:
    """``text`` with ``table`` between the parity markers.

    Example:
        >>> with_table("a\\n<!-- parity:start -->\\nold\\n<!-- parity:end -->\\nb", "new").splitlines()[2]
        'new'
    """
    if START not in text or END not in text:
        raise KeyError(f"docs/presets.md has no {START} ... {END} markers")
    start, end = text.index(START), text.index(END)
    return text[: start + len(START)] + "\n" + table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.items.parity", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="the JSON file (default benchmarks/PARITY.json)")
    p.add_argument("--quick", action="store_true", help="smoke run: GradCAM only of the pytorch-grad-cam rows; "
                                                        "docs/presets.md untouched")
    args = p.parse_args(argv)
    result = run(quick=args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.quick:
        DOC.write_text(with_table(DOC.read_text(), markdown(result)))
    bad = [r["presets"] for r in result["measured"] if r["status"] == "ok" and not r["presets"].startswith(
        "legrad_cls") and r["max_abs_diff"] > 1e-4]
    print(f"wrote {args.out}" + ("" if args.quick else f" and {DOC}") + (f"; over 1e-4: {bad}" if bad else ""))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

