"""Size of the exported Explorer (``vc.export_html``) and its repaint time in a real browser.

Sizes: the bundled shapes-vit on its sample image, and timm ``vit_base_patch16_224`` (random init, 224x224
input), each with the default axes (site x layer x weighting x target x class on the traced top-5 classes),
stored as uint8 and float16, plus one narrowed export (one site, last layer) to show what ``axes=`` saves.
Repaint: the shapes-vit file opened from ``file://`` in Debian's headless Chromium (Playwright); each sample
is one change of a select (site, weighting, target, class in turn), timed by the page from the input event to
the end of the canvas draw (``data-last-paint-latency-ms``, the same hook as the kernel widget's benchmark).

Run:  ``python -m benchmarks.export_html [--quick] [--out benchmarks/EXPORT_HTML.json]``
(``--quick``: shapes-vit and the repaint only; an existing ``--out`` keeps its ViT-B/16 sizes, with their
date). The export section of ``docs/performance.md`` is written from the JSON by ``--readme``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
README_START, README_END = "<!-- export-html:start -->", "<!-- export-html:end -->"


def _export(tr, path: Path, **kwargs) -> dict:
    import vitcam_nb as vc

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        vc.export_html(tr, path, progress=False, **kwargs)
    seconds = time.perf_counter() - start
    return {"mb": round(path.stat().st_size / 1e6, 3), "export_s": round(seconds, 1),
            "axes": kwargs.get("axes") or "default", "quantize": kwargs.get("quantize", "uint8")}


def _repaint(path: Path, samples: int = 40) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "ui"))
    from lab_harness import browser_page, chromium_missing_reason

    reason = chromium_missing_reason()
    if reason:
        return {"n": 0, "reason": reason}
    times, draws, refused = [], [], 0
    with browser_page() as page:
        page.goto(path.as_uri())
        page.wait_for_function("document.body.dataset.loaded === 'true'", timeout=60_000)
        fields = page.evaluate("() => window.vitcamExplorer.get('options').fields"
                               ".filter((f) => f.kind === 'select' && f.values.length > 1)"
                               ".map((f) => [f.name, f.values.map((v) => JSON.stringify(v[0]))])")
        for i in range(samples + 4):
            name, values = fields[i % len(fields)]
            root = page.locator(".vc-explorer")
            before = root.get_attribute("data-paint-count")
            control = page.locator(f"select[data-field='{name}']")
            previous = control.input_value()
            control.select_option(value=values[(i // len(fields) + 1) % len(values)])
            page.wait_for_function("(n) => { const r = document.querySelector('.vc-explorer');"
                                   " return r.dataset.paintCount !== n || r.dataset.error === 'true'; }",
                                   arg=before, timeout=10_000)
            if root.get_attribute("data-error") == "true":
                # A recipe the export holds as a refusal (e.g. Score-CAM on a trace without vc.score's outputs):
                # not a repaint; go back to the shown recipe.
                refused += 1
                control.select_option(value=previous)
                page.wait_for_function("() => document.querySelector('.vc-explorer').dataset.error === 'false'",
                                       timeout=10_000)
                continue
            if i >= 4:  # the first changes warm the JIT
                times.append(float(root.get_attribute("data-last-paint-latency-ms")))
                draws.append(float(root.get_attribute("data-last-draw-ms")))
    return {"n": len(times), "refused_changes_skipped": refused, "median_ms": round(statistics.median(times), 2),
            "p90_ms": round(float(np.percentile(times, 90)), 2), "draw_median_ms": round(statistics.median(draws), 2)}


def run(quick: bool = False, vitb_only: bool = False) -> dict:
    """Measure sizes and the repaint (``vitb_only``: the ViT-B/16 sizes alone); returns the JSON-able result."""
    import timm
    import torch

    import vitcam_nb as vc

    torch.set_num_threads(1)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {platform.processor() or '?'}"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not vitb_only:
            _shapes(out, tmp)
        if not quick:
            model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
            image = (np.random.default_rng(0).random((224, 224, 3)) * 255).astype(np.uint8)
            vitb = vc.trace(model, image)
            out["vit_b16"] = {"uint8": _export(vitb, tmp / "vitb-uint8.html"),
                              "narrow": _export(vitb, tmp / "vitb-narrow.html", axes={"site": ["F1"], "layer": [-1]})}
    return out


def _shapes(out: dict, tmp: Path) -> None:
    import vitcam_nb as vc

    shapes = vc.trace(vc.load_model("shapes-vit"), vc.sample_image("shapes", 0))
    out["shapes_vit"] = {q: _export(shapes, tmp / f"shapes-{q}.html", quantize=q) for q in ("uint8", "float16")}
    out["shapes_vit"]["narrow"] = _export(shapes, tmp / "shapes-narrow.html", axes={"site": ["F1"], "layer": [-1]})
    out["repaint"] = _repaint(tmp / "shapes-uint8.html")


def readme_section(result: dict) -> str:
    """The README lines of a result."""
    s = result["shapes_vit"]
    quick = "vit_b16" not in result or result.get("vit_b16_date", result["date"]) != result["date"]
    lines = [f"Exported explorer (`python -m benchmarks.export_html{' --quick' if quick else ''}`, "
             f"{result['date']}): shapes-vit, default axes: "
             f"{s['uint8']['mb']} MB as uint8, {s['float16']['mb']} MB as float16 (budget 3 MB); one site and the "
             f"last layer: {s['narrow']['mb']} MB."]
    if "vit_b16" in result:
        v = result["vit_b16"]
        when = f" (measured {result['vit_b16_date']})" if result.get("vit_b16_date", result["date"]) != \
            result["date"] else ""
        lines.append(f"ViT-B/16, default axes: {v['uint8']['mb']} MB as uint8 (budget 25 MB), written in "
                     f"{v['uint8']['export_s']} s; one site and the last layer: {v['narrow']['mb']} MB{when}.")
    r = result["repaint"]
    if r.get("n"):
        lines.append(f"In-page repaint after a control change (headless Chromium, median of {r['n']}): "
                     f"{r['median_ms']} ms (p90 {r['p90_ms']} ms; the draw alone {r['draw_median_ms']} ms).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "EXPORT_HTML.json"))
    parser.add_argument("--readme", action="store_true", help="rewrite the README section from --out only")
    parser.add_argument("--vitb-only", action="store_true", help="measure ViT-B/16 alone, merged into --out")
    args = parser.parse_args(argv)
    if not args.readme:
        result = run(args.quick, args.vitb_only)
        previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        if args.vitb_only and previous:
            result = {**previous, "vit_b16": result["vit_b16"], "vit_b16_date": result["date"]}
        elif args.quick and "vit_b16" in previous:  # shapes-vit and the repaint again; ViT-B/16 as measured then
            result = {**result, "vit_b16": previous["vit_b16"],
                      "vit_b16_date": previous.get("vit_b16_date", previous["date"])}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    result = json.loads(Path(args.out).read_text())
    readme = ROOT / "docs" / "performance.md"  # the README links to this page
    text = readme.read_text()
    if README_START in text:
        head, rest = text.split(README_START, 1)
        text = head + README_START + "\n" + readme_section(result) + "\n" + README_END + rest.split(README_END, 1)[1]
        readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
