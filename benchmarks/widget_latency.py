"""Widget repaint latency in a real browser: JupyterLab on localhost, Debian's headless Chromium (Playwright),
an Explorer on a ViT-B/16 trace (timm ``vit_base_patch16_224``, random init, 224x224 input).

Each sample is one press of an arrow key on the Explorer's layer slider (a real input event), timed by
the page itself: from ``performance.now()`` at the input event, through the send (at once: the page is idle
between presses; slider input is debounced only while a request is in flight), the kernel round trip
(``vc.cam(tr, recipe, grid=True)`` and the binary grid message), the report and the bilinear upsampling and
colouring, to the end of the canvas draw; the widget records it in ``data-last-paint-latency-ms``, with the
wait to send and the round trip apart.

The presses run twice, on a JupyterLab server with the ``vitcam_nb_nodelay`` extension (as a pip install of
vitcam_nb enables it) and on the same server without it: stock jupyter_server leaves Nagle's algorithm on its
websockets, and about half of the kernel's answers then wait ~40 ms for the browser's delayed acknowledgement.

A second Explorer on the same trace keeps its neighbour prefetch on (the first has ``prefetch=False``, so each of
its changes is a kernel round trip): each of its samples is a press whose view the page already holds,
timed from the input event to the end of the draw from the page's cache (``data-last-cached-paint-ms``);
before the next press the benchmark waits for the kernel's answer, the prefetch of the next neighbours and
their drawing off screen (the page does that while idle; a quicker press paints the cached map in full).

Run:  ``python benchmarks/widget_latency.py [--quick]``  -> prints JSON
``{"widget_repaint_median_ms": ..., "n": ...}`` (plus p90, min, max, the draw time alone and the setup).
The benchmark suite calls :func:`run`. Needs /usr/bin/chromium and playwright; without them ``run``
returns n = 0 and a reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

_HARNESS = Path(__file__).resolve().parents[1] / "tests" / "ui" / "lab_harness.py"

NOTEBOOK_CELL = """
import numpy as np, timm, torch
import vitcam_nb as vc
from vitcam_nb.widgets import Explorer

model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
image = (np.random.default_rng(0).random((224, 224, 3)) * 255).astype(np.uint8)
tr = vc.trace(model, image)
ex = Explorer(tr, vc.Recipe(site="F1", layer=-1), prefetch=False)
ex
"""

CACHED_CELL = """
cached = Explorer(tr, vc.Recipe(site="F1", layer=-1))
cached
"""

_WAIT_PAINTED = """([prev, nth]) => {
  const r = document.querySelectorAll('.vc-explorer')[nth];
  return !!r && r.dataset.requestId !== undefined && Number(r.dataset.requestId) > prev
    && r.dataset.lastPaintRequest === r.dataset.requestId && r.dataset.state === 'ready';
}"""


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vitcam_lab_harness", _HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_WAIT_CACHED = """([key, prev]) => {
  const r = document.querySelectorAll('.vc-explorer')[1];
  return !!r && Number(r.dataset[key] || 0) > prev;
}"""


def _request_id(page, nth: int = 0) -> int:
    return int(page.locator(".vc-explorer").nth(nth).evaluate("(r) => Number(r.dataset.requestId || 0)"))


def _count(page, key: str) -> int:
    return int(page.locator(".vc-explorer").nth(1).evaluate(f"(r) => Number(r.dataset.{key} || 0)"))


def _cached_samples(page, n: int, warmup: int) -> tuple[list[float], int]:
    """Presses on the prefetching Explorer's layer slider; the paint-from-cache time of each, and the misses."""
    slider = page.locator(".vc-explorer").nth(1).locator("input[data-field='layer']")
    slider.focus()
    layers = int(slider.get_attribute("max")) + 1
    page.wait_for_function(_WAIT_CACHED, arg=["prefetchCount", 0], timeout=120_000)
    page.wait_for_function("() => document.querySelectorAll('.vc-explorer')[1].dataset.prerenderPending === '0'",
                           timeout=60_000)
    position, step = layers - 1, -1
    samples, misses = [], 0
    for i in range(warmup + n):
        if not 0 <= position + step < layers:
            step = -step
        position += step
        prev_req, prev_cached, prev_pre = _request_id(page, 1), _count(page, "cachedPaintCount"), \
            _count(page, "prefetchCount")
        page.keyboard.press("ArrowLeft" if step < 0 else "ArrowRight")
        page.wait_for_function(_WAIT_PAINTED, arg=[prev_req, 1], timeout=60_000)
        if _count(page, "cachedPaintCount") > prev_cached:
            if i >= warmup:
                samples.append(float(page.locator(".vc-explorer").nth(1).get_attribute(
                    "data-last-cached-paint-ms")))
        elif i >= warmup:
            misses += 1
        page.wait_for_function(_WAIT_CACHED, arg=["prefetchCount", prev_pre], timeout=60_000)
        page.wait_for_function("() => document.querySelectorAll('.vc-explorer')[1].dataset.prerenderPending === '0'",
                               timeout=60_000)
    return samples, misses


def _round_trips(page, n: int, warmup: int) -> dict[str, list[float]]:
    """Presses on the first Explorer's layer slider (no prefetch): each one's latency, draw, wait and round trip."""
    slider = page.locator(".vc-explorer input[data-field='layer']").first
    slider.focus()
    layers = int(slider.get_attribute("max")) + 1
    position, step = layers - 1, -1
    out: dict[str, list[float]] = {"latency": [], "draw": [], "wait": [], "round_trip": []}
    attrs = {"latency": "data-last-paint-latency-ms", "draw": "data-last-draw-ms", "wait": "data-last-wait-ms",
             "round_trip": "data-last-round-trip-ms"}
    for i in range(warmup + n):
        if not 0 <= position + step < layers:
            step = -step
        position += step
        prev = _request_id(page)
        page.keyboard.press("ArrowLeft" if step < 0 else "ArrowRight")
        page.wait_for_function(_WAIT_PAINTED, arg=[prev, 0], timeout=60_000)
        if i >= warmup:
            root_el = page.locator(".vc-explorer").first
            for key, attr in attrs.items():
                out[key].append(float(root_el.get_attribute(attr)))
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {"median_ms": round(statistics.median(samples), 2),
            "p90_ms": round(samples[min(len(samples) - 1, int(0.9 * len(samples)))], 2),
            "min_ms": round(samples[0], 2), "max_ms": round(samples[-1], 2)}


def _session(h: ModuleType, tmp: str, nodelay: bool, n: int, warmup: int, cached: bool) -> dict:
    """One JupyterLab server (with or without the vitcam_nb_nodelay extension) and its samples."""
    root = Path(tmp) / f"root-{'nodelay' if nodelay else 'stock'}"
    root.mkdir()
    cells = [NOTEBOOK_CELL, CACHED_CELL] if cached else [NOTEBOOK_CELL]
    h.write_notebook(root / "latency.ipynb", cells)
    with h.LabServer(root, nodelay=nodelay) as lab, h.browser_page() as page:
        h.open_notebook(page, lab, "latency.ipynb")
        h.run_cell(page, 0)
        page.wait_for_selector(".vc-explorer[data-ready='true']", timeout=300_000)
        if cached:
            h.run_cell(page, 1)
            page.wait_for_function("() => document.querySelectorAll(\".vc-explorer[data-ready='true']\").length == 2",
                                   timeout=300_000)
        trips = _round_trips(page, n, warmup)
        hits, misses = _cached_samples(page, n, warmup) if cached else ([], 0)
    return {"trips": trips, "cached": hits, "misses": misses}


def run(quick: bool = False) -> dict:
    """Measure the median control-change-to-repaint latency of the Explorer on a ViT-B/16 trace, on a JupyterLab
    server with the ``vitcam_nb_nodelay`` extension (as a pip install of vitcam_nb enables it) and on one
    without it (stock jupyter_server, Nagle's algorithm on its websockets).

    ``quick``: 10 samples instead of 40 (the ViT-B trace in the kernel dominates either way, ~30 s on
    two CPU cores). Returns ``{"widget_repaint_median_ms": float | None, "n": int, ...}``.

    Example:
        >>> run(quick=True)["n"]   # doctest: +SKIP
        10
    """
    h = _harness()
    reason = h.chromium_missing_reason()
    if reason:
        return {"widget_repaint_median_ms": None, "n": 0, "skipped": reason}
    n = 10 if quick else 40
    warmup = 3
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vitcam-latency-") as tmp:
        shipped = _session(h, tmp, nodelay=True, n=n, warmup=warmup, cached=True)
        stock = _session(h, tmp, nodelay=False, n=n, warmup=warmup, cached=False)
    trips, cached = shipped["trips"], sorted(shipped["cached"])
    latency = _summary(trips["latency"])
    stock_latency = _summary(stock["trips"]["latency"])
    return {
        "widget_repaint_median_ms": latency["median_ms"],
        "n": len(trips["latency"]),
        "p90_ms": latency["p90_ms"],
        "min_ms": latency["min_ms"],
        "max_ms": latency["max_ms"],
        "draw_median_ms": round(statistics.median(trips["draw"]), 2),
        "wait_median_ms": round(statistics.median(trips["wait"]), 2),
        "round_trip_median_ms": round(statistics.median(trips["round_trip"]), 2),
        "server": "JupyterLab with the vitcam_nb_nodelay server extension (kernel websockets without Nagle's delay)",
        "stock_server_median_ms": stock_latency["median_ms"],
        "stock_server_p90_ms": stock_latency["p90_ms"],
        "stock_server_round_trip_median_ms": round(statistics.median(stock["trips"]["round_trip"]), 2),
        "stock_server": "the same JupyterLab with the extension turned off (stock jupyter_server)",
        "control": "layer slider (ArrowLeft/ArrowRight key press), F1, vit_base_patch16_224 random init, 224x224",
        "includes": "wait to send (none when idle) + kernel round trip + report, upsample/colour/draw",
        "cached_repaint_median_ms": round(statistics.median(cached), 2) if cached else None,
        "cached_n": len(cached),
        "cached_misses": shipped["misses"],
        "cached_p90_ms": round(cached[min(len(cached) - 1, int(0.9 * len(cached)))], 2) if cached else None,
        "cached_max_ms": round(cached[-1], 2) if cached else None,
        "cached_includes": "prefetching Explorer: input event to the end of the draw from the page's cache",
        "total_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 samples instead of 40")
    args = parser.parse_args(argv)
    print(json.dumps(run(quick=args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
