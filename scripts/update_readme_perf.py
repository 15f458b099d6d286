"""Write the performance table (``docs/performance.md``, which the README links to) from a benchmark JSON, between
``<!-- perf:start -->`` and ``<!-- perf:end -->``; nothing outside the markers is touched.

Usage::

    python scripts/update_readme_perf.py                      # benchmarks/RESULTS.json -> docs/performance.md
    python scripts/update_readme_perf.py --results benchmarks/results/latest.json --readme docs/performance.md
    python scripts/update_readme_perf.py --check              # exit 1 if docs/performance.md is not up to date

Below the table, lines compare the gallery with the peers' one-pass galleries and give the trace's page faults
(from the same results). Next to the results file, ``TRACE_MANY.json``, ``AGAINST.json``, ``LOAD.json``,
``AMBIGUITY.json`` and ``SCALE.json`` (``python -m benchmarks.trace_many``, ``python -m benchmarks.against``,
``python -m benchmarks.load``, ``python -m benchmarks.ambiguity`` and ``python -m benchmarks --items scale``) each
add a line below the table when they exist.

If the README has no markers, the table is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import README_END, README_START, readme_table  # noqa: E402


def replace_between_markers(text: str, body: str) -> str | None:
    """``text`` with everything between the perf markers replaced by ``body``; None if a marker is missing.

    Example:
        >>> replace_between_markers("a\\n<!-- perf:start -->\\nold\\n<!-- perf:end -->\\nb", "new")
        'a\\n<!-- perf:start -->\\nnew\\n<!-- perf:end -->\\nb'
        >>> replace_between_markers("no markers", "new") is None
        True
    """
    start = text.find(README_START)
    end = text.find(README_END, start + len(README_START)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return text[: start + len(README_START)] + "\n" + body.strip("\n") + "\n" + text[end:]


def extra_rows(results: dict, trace_many_path: Path) -> str:
    """Lines for the widget latency (from the suite's JSON) and the trace_many benchmark (its own JSON).

    Example:
        >>> extra_rows({"widget_latency": {"status": "skipped"}}, Path("/nonexistent.json"))
        ''
    """
    lines = []
    widget = results.get("widget_latency", {})
    if widget.get("status") == "ok":
        w = widget["result"]
        lines.append(f"- Widget repaint, control change in headless Chromium to repainted canvas "
                     f"(ViT-B/16 trace): median {w['widget_repaint_median_ms']:.1f} ms over {w['n']} changes "
                     f"(p90 {w['p90_ms']:.1f} ms).")
        if w.get("stock_server_median_ms") is not None:
            lines.append(f"  That is on JupyterLab with the `vitcam_nb_nodelay` server extension (kernel round trip "
                         f"median {w['round_trip_median_ms']:.1f} ms, draw {w['draw_median_ms']:.1f} ms); on the "
                         f"same server without it (stock jupyter_server, Nagle's algorithm on its websockets) the "
                         f"median is {w['stock_server_median_ms']:.1f} ms (p90 {w['stock_server_p90_ms']:.1f} ms).")
        if w.get("cached_repaint_median_ms") is not None:
            lines.append(f"- Widget repaint of a view already in the page (neighbour prefetch): median "
                         f"{w['cached_repaint_median_ms']:.1f} ms over {w['cached_n']} changes (p90 "
                         f"{w['cached_p90_ms']:.1f} ms, {w['cached_misses']} not cached).")
    if trace_many_path.is_file():
        tm = json.loads(trace_many_path.read_text())
        t, m = tm["throughput"], tm["memory"]
        rise = {k: v / 2**20 for k, v in m["peak_rise_bytes"].items()}
        lines.append(f"- `trace_many` on {tm['model']} ({tm['settings']['sites']}, {tm['settings']['dtype']}, "
                     f"batch {tm['settings']['batch_size']}): {t['trace_many_images_per_s']:.1f} images/s against "
                     f"{t['loop_trace_save_images_per_s']:.1f} for a loop of trace() + save() "
                     f"({t['speedup']:.1f}x); peak memory rise "
                     + ", ".join(f"{v:.0f} MiB at {k} images" for k, v in rise.items())
                     + f" ({'flat' if m['flat'] else 'NOT flat'}). From `{tm['command']}` "
                     f"(benchmarks/TRACE_MANY.json).")
    return "\n".join(lines)


def gallery_row(results: dict, model: str = "vit_base_patch16_224") -> str:
    """The line for the gallery against the peers' one-pass galleries (both measured in the same run of
    ``python -m benchmarks``); empty for a quick run or without peers. The README states measured figures; the
    targets and verdicts are in benchmarks/RESULTS.md.

    Example:
        >>> g = {"vc_gallery": {"median_s": 0.008}, "torchcam_one_pass": {"median_s": 0.72},
        ...      "pytorch_grad_cam_one_pass": {"median_s": 1.1}, "pytorch_grad_cam_loop": {"median_s": 60.0},
        ...      "speedup_vs_torchcam_one_pass": 90.0, "speedup_vs_pytorch_grad_cam_one_pass": 137.5,
        ...      "speedup_vs_pytorch_grad_cam_loop": 7500.0}
        >>> row = gallery_row({"models": {"m": {"gallery": g}}, "created": "2026-12-01T10:00:00"}, "m")
        >>> "`vc.gallery` 8.0 ms;" in row, "(torchcam) ×90.0;" in row, "target" in row
        (True, True, False)
    """
    g = results.get("models", {}).get(model, {}).get("gallery")
    if results.get("quick") or not isinstance(g, dict) or "vc_gallery" not in g:
        return ""
    peers = {"torchcam_one_pass": "torchcam with every layer hooked, one backward and a retained graph",
             "pytorch_grad_cam_one_pass": "pytorch-grad-cam with every layer hooked, one forward and backward"}
    present = [k for k in peers if k in g]
    if not present:
        return ""
    fastest = min(present, key=lambda k: g[k]["median_s"])
    ours = g["vc_gallery"]["median_s"]
    ratio = g[f"speedup_vs_{fastest}"]
    when = next((u["created"] for u in reversed(results.get("partial_updates", []))
                 if u["item"] == f"{model}/gallery"), results.get("created", ""))[:10]
    others = "; ".join(f"{peers[k]}: {g[k]['median_s']:.2f} s, ×{g[f'speedup_vs_{k}']:,.0f}" for k in present)
    loop = (f"; pytorch-grad-cam's one call per variant: {g['pytorch_grad_cam_loop']['median_s']:.1f} s, "
            f"×{g['speedup_vs_pytorch_grad_cam_loop']:,.0f}") if "pytorch_grad_cam_loop" in g else ""
    cold = g.get("vc_gallery_cold_caches")
    first = (f" The first gallery on a trace, which also fills the trace's caches (view, checklist, activation "
             f"norms): {cold['median_s'] * 1e3:.1f} ms, ×{g[f'speedup_vs_{fastest}_cold_caches']:.1f}."
             ) if cold and f"speedup_vs_{fastest}_cold_caches" in g else ""
    return (f"- Gallery against the peers ({model}, 60 maps, same run): `vc.gallery` {ours * 1e3:.1f} ms; "
            f"{others}{loop}. Against the fastest peer's one pass "
            f"({fastest.removesuffix('_one_pass').replace('_', '-')}) ×{ratio:.1f}; medians of per-round ratios, "
            f"measured {when}.{first}")


def trace_faults_row(results: dict, model: str = "vit_base_patch16_224") -> str:
    """The line for the page faults and system time of ``vc.trace`` and its baseline (item 1's ``page_faults``);
    empty when the results do not hold them.

    Example:
        >>> pf = {"trace": {"minor_faults": 300000, "system_s": 0.8},
        ...       "baseline_autograd": {"minor_faults": 4000, "system_s": 0.03}}
        >>> "300,000 minor page faults" in trace_faults_row({"models": {"m": {"trace_cost": {"page_faults": pf}}}}, "m")
        True
    """
    pf = results.get("models", {}).get(model, {}).get("trace_cost", {}).get("page_faults")
    if results.get("quick") or not pf or "trace" not in pf or "baseline_autograd" not in pf:
        return ""
    t, b = pf["trace"], pf["baseline_autograd"]
    return (f"- Page faults in item 1 ({model}): `vc.trace` {t['minor_faults']:,} minor page faults and "
            f"{t['system_s']:.2f} s of system CPU per call, the baseline {b['minor_faults']:,} and "
            f"{b['system_s']:.2f} s. The trace writes every value and gradient into the Dataset's arrays as the "
            "backward pass produces them and keeps the memory autograd frees for the next block; it hands memory "
            "back to the system (glibc `malloc_trim`) only when it has added more than 1.15 times the Dataset "
            "(see Memory), so its pages are rarely faulted in twice.")


def against_row(against_path: Path) -> str:
    """The line for ``python -m benchmarks.against`` (its own JSON): new/base ratios per item;
    empty if the file is missing or holds a ``--quick`` run, whose timings are no claim.

    Example:
        >>> against_row(Path("/nonexistent.json"))
        ''
    """
    if not against_path.is_file():
        return ""
    a = json.loads(against_path.read_text())
    if a.get("quick"):
        return ""
    items = a["items"]
    threads = a["settings"]["threads"]
    ratios = ", ".join(f"{label} ×{items[key]['ratio']:.2f}"
                       for key, label in (("trace", "trace"), ("one_variant", "one variant"), ("gallery", "gallery")))
    return (f"- Redesign against {a['base']['version']} ({a['base']['commit'][:7]}), side by side on {a['model']}, "
            f"{threads} thread{'' if threads == 1 else 's'}: {ratios} (new/old, medians of "
            f"{a['settings']['rounds']} per-round ratios). "
            f"Measured {a['created'][:10]} on {a['machine']['cpu_model']}, from `{a['command']}` "
            "(benchmarks/AGAINST.json; where each ratio comes from: benchmarks/README.md).")


def load_row(load_path: Path) -> str:
    """The line for ``python -m benchmarks.load`` (its own JSON): the 60-map gallery with the machine as it was
    and with one extra CPU-bound process, side by side; empty if the file is missing.

    Example:
        >>> load_row(Path("/nonexistent.json"))
        ''
    """
    if not load_path.is_file():
        return ""
    a = json.loads(load_path.read_text())
    ratio = a["busy_over_as_is"]
    load = "/".join(f"{v:.2f}" for v in a["load_average_start"])
    return (f"- Gallery on a busy machine ({a['model']}, {a['maps']} maps): {a['as_is_median_s'] * 1e3:.1f} ms as the "
            f"machine was, {a['busy_median_s'] * 1e3:.1f} ms with one more CPU-bound process, ×{ratio:.2f} (median of "
            f"{a['rounds']} interleaved per-round ratios); {a['cpus']} CPUs, load average {load} at start"
            + (", so \"as the machine was\" was not quiet" if a["load_average_start"][0] > 0.5 * a["cpus"] else "")
            + f". Measured {a['date']}, `{a['command']}` (benchmarks/LOAD.json).")


def ambiguity_row(ambiguity_path: Path) -> str:
    """The line for ``python -m benchmarks.ambiguity`` (its own JSON): the whole ``vc.ambiguity`` analysis of the
    largest description of at most 500 recipes and the other descriptions; empty if the file is missing.

    Example:
        >>> ambiguity_row(Path("/nonexistent.json"))
        ''
    """
    if not ambiguity_path.is_file():
        return ""
    a = json.loads(ambiguity_path.read_text())
    rows = sorted((r for r in a["rows"] if r["recipes"] <= 500), key=lambda r: r["recipes"])
    if not rows:
        return ""
    top = rows[-1]
    others = ", ".join(f"{r['recipes']} recipes {r['first_call_s']:.2f} s" for r in rows[:-1])
    context = (f"; {a['cpus']} CPUs, load average {'/'.join(f'{v:.2f}' for v in a['load_average_start'])} at start, "
               f"measured {a['date']}") if "date" in a else ""
    return (f"- `vc.ambiguity` on one {a['model']} trace, {a['threads']} thread{'' if a['threads'] == 1 else 's'}: "
            f"the whole analysis (recipes, maps, spread, sensitivity; {top['design']}) of a description leaving "
            f"{top['recipes']} recipes open (\"{top['description']}\") takes {top['first_call_s']:.2f} s on its first "
            f"call, median {top['median_repeat_s']:.2f} s over {a.get('repeat', 3)} repeats"
            + (f" (first calls with fewer recipes: {others})" if others else "")
            + f"{context}. "
            f"From `{a['command']}` (benchmarks/AMBIGUITY.json).")


def scale_row(scale_path: Path) -> str:
    """The line for ``python -m benchmarks --items scale`` (SCALE.json): ``vc.map_many`` against ``vc.trace()``, the
    store's bytes per image, pytorch-grad-cam per map and two workers against one; empty if the file is missing.

    Example:
        >>> scale_row(Path("/nonexistent.json"))
        ''
    """
    if not scale_path.is_file():
        return ""
    a = json.loads(scale_path.read_text())
    st, ratio, pgc, cl = a["settings"], a["map_many_vs_trace"], a["pytorch_grad_cam"], a["cluster"]
    m = a["machine"]
    return (f"- Maps of many images, {a['model'].split(' ')[0]}, {st['recipes']} recipes ({st['space']}), "
            f"{st['images']} images at batch {st['batch_size']}: `vc.map_many` "
            f"{a['images_per_s']['map_many_numpy']:.3f} "
            f"images/s with NumPy (x{ratio['map_many_numpy']:.2f} `vc.trace()` alone, which traces every site of every "
            f"block), x{ratio['map_many_torch']:.2f} with `backend=\"torch\"`; the store adds "
            f"{a['store_mb_per_image']['numpy']:.2f} MB per image (plus {a['store']['fixed_mb']['numpy']:.1f} MB once "
            f"for the recipe table); pytorch-grad-cam computing the maps it can express costs "
            f"x{pgc['ratio_one_call_each']:,.0f} per map with one call each and x{pgc['ratio_best_case']:,.0f}"
            f" with five layers hooked in one pass "
            f"({pgc['extrapolation']}); a 2-worker `LocalCluster` against one worker: {_cluster_ratio(cl)} "
            f"({cl['images']} images; {cl['note']}). {m['usable_cpus']} CPUs, load average "
            f"{'/'.join(f'{v:.2f}' for v in m['load_average_start'])} at start, measured {a['date']}, "
            f"`{a['command']}` (benchmarks/SCALE.json).")


def _cluster_ratio(cl: dict) -> str:
    """Two workers against one: on a cluster that has run a call and on fresh workers (files written before the
    two calls per cluster have one ratio)."""
    if "warm" not in cl:
        return f"x{cl['ratio']:.2f}"
    return (f"x{cl['warm']['ratio']:.2f} on a cluster that has run a call before, x{cl['fresh']['ratio']:.2f} on fresh "
            "workers, which import torch, timm and the kit during the call")


def main(argv: list[str] | None = None) -> int:
    """Update (or, with ``--check``, verify) the README's performance section; returns the exit status."""
    p = argparse.ArgumentParser(prog="python scripts/update_readme_perf.py", description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.json")
    p.add_argument("--readme", type=Path, default=ROOT / "docs" / "performance.md")
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if the README is out of date")
    args = p.parse_args(argv)
    if not args.results.is_file():
        print(f"{args.results} does not exist; run `python -m benchmarks` first", file=sys.stderr)
        return 2
    results = json.loads(args.results.read_text())
    body = readme_table(results)
    extra = "\n".join(line for line in (gallery_row(results), trace_faults_row(results),
                                         extra_rows(results, args.results.parent / "TRACE_MANY.json"),
                                         against_row(args.results.parent / "AGAINST.json"),
                                         load_row(args.results.parent / "LOAD.json"),
                                         ambiguity_row(args.results.parent / "AMBIGUITY.json"),
                                         scale_row(args.results.parent / "SCALE.json")) if line)
    if extra:
        body = body.rstrip("\n") + "\n\n" + extra
    text = args.readme.read_text() if args.readme.is_file() else ""
    updated = replace_between_markers(text, body)
    if updated is None:
        print(body)
        print(f"\n{args.readme} has no {README_START} ... {README_END} markers: the table is printed above; "
              "ask the README's owner to add the markers", file=sys.stderr)
        return 1
    if args.check:
        if updated != text:
            print(f"{args.readme} is out of date with {args.results}", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.readme.write_text(updated)
        print(f"updated the performance section of {args.readme}")
    else:
        print(f"{args.readme} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
