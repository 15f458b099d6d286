"""Markdown renderings of a benchmark results dict: the full report and the README performance table."""

from __future__ import annotations

README_START = "<!-- perf:start -->"
README_END = "<!-- perf:end -->"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _cpu(entry: dict) -> str:
    return _ms(entry.get("cpu_median_s")) if entry.get("cpu_median_s") is not None else "—"


def _mb(n: int | float | None) -> str:
    return "—" if n is None else f"{n / 2**20:.1f} MiB"


def _value(row: dict) -> str:
    v = row["value"]
    if row["target"] == "gallery_seconds":
        return _ms(v)
    if row["target"] == "single_variant_speedup":
        return f"{v:,.0f}×"
    return f"{v:.3f}×"


def _cpu_value(row: dict) -> str:
    v = row.get("cpu_value")
    if v is None:
        return "—"
    return _value({**row, "value": v})


def _threshold(row: dict) -> str:
    t = row["threshold"]
    if row["target"] == "gallery_seconds":
        return f"{row['op']} {_ms(t)}"
    if row["target"] == "single_variant_speedup":
        return f"{row['op']} {t:,.0f}×"
    return f"{row['op']} {t:g}×"


def machine_line(results: dict) -> str:
    """One line: CPU (or GPU), cores, load average at start and end, torch threads.

    Example:
        >>> machine_line({"machine": {"cpu_model": "X", "usable_cpus": 2, "logical_cpus": 2,
        ...     "load_average_start": [1, 1, 1], "torch_threads": 2}, "device": "cpu"})
        'X, 2 usable of 2 logical CPUs, torch threads 2, device cpu, load average (1/5/15 min) 1.00/1.00/1.00 at start'
    """
    m = results["machine"]
    parts = [m.get("gpu") or m["cpu_model"], f"{m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs",
             f"torch threads {m['torch_threads']}", f"device {results['device']}"]
    load = m.get("load_average_start")
    if load:
        text = "load average (1/5/15 min) " + "/".join(f"{v:.2f}" for v in load) + " at start"
        end = m.get("load_average_end")
        if end:
            text += ", " + "/".join(f"{v:.2f}" for v in end) + " at end"
        parts.append(text)
    return ", ".join(parts)


def versions_line(results: dict) -> str:
    """``name version`` for everything measured, absent packages as "not installed".

    Example:
        >>> versions_line({"versions": {"torch": "2.0", "torchcam": None}})
        'torch 2.0, torchcam not installed'
    """
    return ", ".join(f"{k} {v or 'not installed'}" for k, v in results["versions"].items())


def targets_table(results: dict, official_only: bool = False) -> str:
    """The targets as a markdown table (measured value, threshold, holds).

    Example:
        >>> print(targets_table({"targets": []}))
        | target | model | measured (wall) | same from CPU time | target | holds |
        |---|---|---|---|---|---|
    """
    lines = ["| target | model | measured (wall) | same from CPU time | target | holds |",
             "|---|---|---|---|---|---|"]
    for row in results["targets"]:
        if official_only and not row["official"]:
            continue
        lines.append(f"| {row['what']} | {row['model']} | {_value(row)} | {_cpu_value(row)} | {_threshold(row)} | "
                     f"{'yes' if row['holds'] else '**no**'} |")
    return "\n".join(lines)


def _model_section(name: str, res: dict) -> list[str]:
    out = [f"### {name}", ""]
    if res.get("status") != "ok":
        return out + [f"Skipped: {res.get('note', '')}", ""]
    out += [res["description"], ""]
    tc = res["trace_cost"]
    out += [
        f"**1. Trace cost** (K={tc['k']}: {tc['n_targets']} gradient targets; medians of {tc['trace']['n']} "
        "interleaved rounds; ratio = median of the per-round ratios)", "",
        "| what | median | CPU time | ratio trace / this |", "|---|---|---|---|",
        f"| `vc.trace()` (forward + one batched autograd.grad + Dataset) | {_ms(tc['trace']['median_s'])} | "
        f"{_cpu(tc['trace'])} | 1 |",
        f"| forward + {tc['n_targets']} × autograd.grad w.r.t. the hooked tensors | "
        f"{_ms(tc['baseline_autograd']['median_s'])} | {_cpu(tc['baseline_autograd'])} | "
        f"{tc['ratio_vs_autograd']:.3f} |",
        f"| forward + {tc['n_targets']} × loss.backward() (parameter grads too) | "
        f"{_ms(tc['baseline_backward']['median_s'])} | {_cpu(tc['baseline_backward'])} | "
        f"{tc['ratio_vs_backward']:.3f} |",
        f"| one plain forward (timm default attention) | {_ms(tc['forward']['median_s'])} | {_cpu(tc['forward'])} | "
        f"{tc['ratio_vs_forward']:.2f} |",
        f"| first `vc.trace()` on this model (weights hash not cached) | "
        f"{_ms(tc['first_trace']['median_s']['total'])} | | |", "",
        "Where the time of `vc.trace()` goes (median seconds over instrumented calls):", "",
        "| phase | time | share |", "|---|---|---|",
    ]
    bd = tc["breakdown"]
    for phase, secs in bd["median_s"].items():
        if phase == "total":
            continue
        out.append(f"| {phase} | {_ms(secs)} | {bd['fraction_of_total'][phase] * 100:.1f} % |")
    out.append(f"| total | {_ms(bd['median_s']['total'])} | |")
    first = tc["first_trace"]["median_s"]
    out += ["", f"First call: weights hash {_ms(first.get('assembly: weights hash'))} (cached per model afterwards).",
            ""]
    sv = res["single_variant"]
    out += [
        f"**2. One variant** ({sv['what']}; recipe `{sv['recipe_id']}`)", "",
        "| what | median | CPU time | speedup of `vc.cam()` | max abs diff to `vc.cam()` |", "|---|---|---|---|---|",
        f"| `vc.cam(trace, recipe)` | {_ms(sv['vc_cam']['median_s'])} | {_cpu(sv['vc_cam'])} | 1 | 0 |",
        f"| `vc.cam()` with its caches cleared | {_ms(sv['vc_cam_cold_caches']['median_s'])} | "
        f"{_cpu(sv['vc_cam_cold_caches'])} | {sv['speedup_vs_pytorch_grad_cam_cold_caches']:,.0f}× | |",
        f"| pytorch-grad-cam GradCAM | {_ms(sv['pytorch_grad_cam']['median_s'])} | {_cpu(sv['pytorch_grad_cam'])} | "
        f"{sv['speedup_vs_pytorch_grad_cam']:,.0f}× | {sv['agreement']['pytorch_grad_cam_max_abs_diff']:.1e} |",
    ]
    if "torchcam" in sv:
        out.append(f"| torchcam GradCAM (+ bilinear resize) | {_ms(sv['torchcam']['median_s'])} | "
                   f"{_cpu(sv['torchcam'])} | {sv['speedup_vs_torchcam']:,.0f}× | "
                   f"{sv['agreement']['torchcam_max_abs_diff']:.1e} |")
    g = res["gallery"]
    out += [
        "", f"**3. Gallery**: {g['layers']} layers × {len(g['sites'])} sites = {g['variants']} maps", "",
        "| what | median | CPU time | speedup of `vc.gallery()` | max abs diff to `vc.gallery()` |",
        "|---|---|---|---|---|",
        f"| `vc.gallery(trace, recipe, vary=...)` | {_ms(g['vc_gallery']['median_s'])} | {_cpu(g['vc_gallery'])} "
        "| 1 | 0 |",
        f"| pytorch-grad-cam, public API, one call per variant | {_ms(g['pytorch_grad_cam_loop']['median_s'])} | "
        f"{_cpu(g['pytorch_grad_cam_loop'])} | {g['speedup_vs_pytorch_grad_cam_loop']:,.0f}× | "
        f"{g['agreement']['pytorch_grad_cam_loop']['max_abs_diff']:.1e} |",
        f"| pytorch-grad-cam, all layers hooked, one pass (compute_cam_per_layer) | "
        f"{_ms(g['pytorch_grad_cam_one_pass']['median_s'])} | {_cpu(g['pytorch_grad_cam_one_pass'])} | "
        f"{g['speedup_vs_pytorch_grad_cam_one_pass']:,.0f}× | "
        f"{g['agreement']['pytorch_grad_cam_one_pass']['max_abs_diff']:.1e} |",
    ]
    if "torchcam_one_pass" in g:
        out.append(f"| torchcam, all layers hooked, one backward (retain_graph) | "
                   f"{_ms(g['torchcam_one_pass']['median_s'])} | {_cpu(g['torchcam_one_pass'])} | "
                   f"{g['speedup_vs_torchcam_one_pass']:,.0f}× | "
                   f"{g['agreement']['torchcam_one_pass']['max_abs_diff']:.1e} |")
    out += ["", g["f3_hook"] + ".", ""]
    mem = res["memory"]
    out += [
        "**4. Memory**", "",
        "| what | bytes |", "|---|---|",
        f"| trace Dataset (sum of nbytes of all variables) | {_mb(mem['stored_bytes'])} |",
        f"| captured tensors' own bytes | {_mb(mem['tensor_bytes'])} |",
        f"| ratio | {mem['stored_bytes_ratio']:.4f}× |",
        f"| `vc.save(tr, 'x.nc')` on disk | {_mb(mem['netcdf_bytes'])} ({_ms(mem['save_netcdf_s'])} to save, "
        f"{_ms(mem['load_netcdf_s'])} to load) |",
    ]
    for key, label in (("peak_trace", "peak RSS rise of a first `vc.trace()`"),
                       ("peak_baseline", "peak RSS rise of forward + K+1 autograd.grad")):
        probe = mem.get(key, {})
        if probe.get("status") == "ok":
            out.append(f"| {label} | {_mb(probe['peak_rise_bytes'])} (numpy/Python peak "
                       f"{_mb(probe['python_peak_bytes_tracemalloc'])}) |")
        else:
            out.append(f"| {label} | {probe.get('status', '—')}: {probe.get('note', '')} |")
    out.append("")
    am = derived({"models": {name: res}}).get(name, {})
    if am:
        out += ["**When the trace pays off** (medians above; the trace also holds 5 more targets, F2 and every "
                "other weighting, so this is its least favourable case):", ""]
        out += [f"- {line}" for line in _amortisation_lines(am)] + [""]
    if res.get("note"):
        out += [res["note"], ""]
    return out


def _even(trace: float, peer: dict | None, ours: float) -> float | None:
    if peer is None or peer["median_s"] <= ours:
        return None
    return trace / (peer["median_s"] - ours)


def derived(results: dict) -> dict:
    """Break-even points per measured model, from the medians: after how many single variants (or
    galleries) trace + cam beats recomputing with a peer. ``None`` where the peer is not slower per map.

    Example:
        >>> r = {"models": {"m": {"status": "ok", "trace_cost": {"trace": {"median_s": 6.0}},
        ...     "single_variant": {"vc_cam": {"median_s": 0.001}, "pytorch_grad_cam": {"median_s": 2.001}},
        ...     "gallery": {"vc_gallery": {"median_s": 0.1}, "pytorch_grad_cam_one_pass": {"median_s": 3.1}}}}}
        >>> derived(r)["m"]["variants_to_break_even_vs_pytorch_grad_cam"]
        3.0
    """
    out = {}
    for name, res in results["models"].items():
        if res.get("status") != "ok":
            continue
        trace = res["trace_cost"]["trace"]["median_s"]
        cam = res["single_variant"]["vc_cam"]["median_s"]
        gal = res["gallery"]["vc_gallery"]["median_s"]

        sv, g = res["single_variant"], res["gallery"]
        out[name] = {
            "variants_to_break_even_vs_pytorch_grad_cam": _even(trace, sv.get("pytorch_grad_cam"), cam),
            "variants_to_break_even_vs_torchcam": _even(trace, sv.get("torchcam"), cam),
            "galleries_to_break_even_vs_pytorch_grad_cam_one_pass": _even(trace, g.get("pytorch_grad_cam_one_pass"),
                                                                          gal),
            "galleries_to_break_even_vs_torchcam_one_pass": _even(trace, g.get("torchcam_one_pass"), gal),
        }
        if "pytorch_grad_cam_loop" in g:
            out[name]["trace_plus_gallery_vs_pytorch_grad_cam_loop"] = \
                g["pytorch_grad_cam_loop"]["median_s"] / (trace + gal)
    return out


def _amortisation_lines(am: dict) -> list[str]:
    labels = {
        "variants_to_break_even_vs_pytorch_grad_cam": "single variants before trace + cam beats pytorch-grad-cam",
        "variants_to_break_even_vs_torchcam": "single variants before trace + cam beats torchcam",
        "galleries_to_break_even_vs_pytorch_grad_cam_one_pass": "60-map galleries before trace + gallery beats "
                                                                "pytorch-grad-cam's one-pass",
        "galleries_to_break_even_vs_torchcam_one_pass": "60-map galleries before trace + gallery beats torchcam's "
                                                        "one-pass",
    }
    lines = []
    for key, label in labels.items():
        if key in am:
            v = am[key]
            lines.append(f"{label}: {'never (peer not slower per map)' if v is None else f'{v:.1f}'}")
    if "trace_plus_gallery_vs_pytorch_grad_cam_loop" in am:
        lines.append(f"trace + gallery is {am['trace_plus_gallery_vs_pytorch_grad_cam_loop']:.0f}× faster than "
                     "pytorch-grad-cam's one-call-per-variant loop over the same 60 maps")
    return lines


def markdown(results: dict) -> str:
    """The full report (benchmarks/RESULTS.md): machine, versions, command, targets, per-model details, notes.

    Example:
        >>> md = markdown({"created": "t", "command": "c", "quick": True, "device": "cpu", "wall_s": 1.0,
        ...     "machine": {"cpu_model": "X", "usable_cpus": 1, "logical_cpus": 1, "torch_threads": 1},
        ...     "versions": {}, "models": {}, "targets": [], "notes": [],
        ...     "widget_latency": {"status": "skipped", "note": "n"}, "trace_many": {"status": "not available"}})
        >>> md.startswith("# vitcam_nb benchmarks")
        True
    """
    mode = "quick (CI smoke run: tiny model, few repeats; timings are not claims)" if results["quick"] else "full"
    out = [
        "# vitcam_nb benchmarks", "",
        f"- created: {results['created']} ({mode}, {results['wall_s']:.0f} s)",
        f"- reproduce: `{results['command']}`",
        f"- machine: {machine_line(results)}",
        f"- versions: {versions_line(results)}", "",
        "## Targets (issue #11)", "", targets_table(results), "",
        "## Details", "",
    ]
    for name, res in results["models"].items():
        out += _model_section(name, res)
    wl = results["widget_latency"]
    out += ["**5. Widget latency**: " + (wl["status"] + (f" — {wl['note']}" if wl.get("note") else "")), ""]
    if wl.get("status") == "ok":
        out += ["```json", _compact(wl["result"]), "```", ""]
    tm = results["trace_many"]
    out += ["**6. trace_many throughput**: " + tm["status"] + (f" — {tm['note']}" if tm.get("note") else ""), ""]
    if tm.get("status") == "ok":
        out += ["```json", _compact({k: tm[k] for k in ("throughput", "memory") if k in tm}), "```", ""]
    if results.get("notes"):
        out += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    return "\n".join(out)


def _compact(value: object) -> str:
    import json

    return json.dumps(value, indent=1, default=str)


def measured_table(results: dict, official_only: bool = False) -> str:
    """The measured figures as a markdown table, without the targets and verdicts (those are in RESULTS.md).

    Example:
        >>> print(measured_table({"targets": []}))
        | what | model | measured (wall) | same from CPU time |
        |---|---|---|---|
    """
    lines = ["| what | model | measured (wall) | same from CPU time |", "|---|---|---|---|"]
    for row in results["targets"]:
        if official_only and not row["official"]:
            continue
        lines.append(f"| {row['what']} | {row['model']} | {_value(row)} | {_cpu_value(row)} |")
    return "\n".join(lines)


def readme_table(results: dict) -> str:
    """The README's performance section body: the measured figures of the official items (all rows if none are
    official), the machine and the command to reproduce.

    Example:
        >>> r = {"created": "2026-01-01", "command": "python -m benchmarks", "quick": False, "device": "cpu",
        ...      "machine": {"cpu_model": "X", "usable_cpus": 2, "logical_cpus": 2, "torch_threads": 2},
        ...      "versions": {"torch": "2"}, "targets": []}
        >>> "python -m benchmarks" in readme_table(r)
        True
    """
    official = any(row["official"] for row in results["targets"])
    lines = [measured_table(results, official_only=official), "",
             f"Measured {results['created'][:10]} on {machine_line(results)}; {versions_line(results)}. "
             "Ratios are medians of per-round ratios from interleaved runs in one process; the CPU-time column "
             "shows what a busy machine does to the wall time. Reproduce with "
             f"`{results['command']}`; details, peers (pytorch-grad-cam, torchcam) and the memory figures are in "
             "`benchmarks/RESULTS.md`."]
    if results["quick"]:
        lines.append("")
        lines.append("(from a `--quick` run: a tiny model and few repeats; these numbers are not claims)")
    return "\n".join(lines)


def notes(results: dict) -> list[str]:
    """Observations every report states, plus what the numbers say (e.g. where trace() spends its time).

    Example:
        >>> notes({"models": {}, "quick": True, "device": "cpu", "machine": {},
        ...        "widget_latency": {"status": "skipped", "note": "x"}, "trace_many": {"status": "n/a"}})[0][:5]
        'Quick'
    """
    out = []
    for upd in results.get("partial_updates", []):
        out.append(f"{upd['item']} is from a later run limited to some items ({upd['created']}, `{upd['command']}`); "
                   "the other items are from the run this report is dated by.")
    if results["quick"]:
        out.append("Quick mode: tiny model and few repeats; it checks that the suite runs, the timings are not claims.")
    load = results["machine"].get("load_average_start")
    cpus = results["machine"].get("usable_cpus")
    if load and cpus and load[0] > 0.5 * cpus:
        out.append(f"The machine was busy (1-min load {load[0]:.2f} on {cpus} CPUs at start): absolute times are "
                   "inflated and noisy; the side-by-side ratios are the meaningful figures.")
    out.append("vc.trace() sets fused_attn=False while tracing (site F2 needs the softmax matrix), so its forward is "
               "timm's explicit attention; the plain baseline of item 1 hooks the same sites and also runs "
               "unfused. pytorch-grad-cam and torchcam run with timm's default (fused) attention: their best.")
    out.append("The input tensor is passed to vc.trace() on the CPU and moved by trace(device=...); the baselines "
               "and peers get it on the device directly.")
    for name, res in results["models"].items():
        if res.get("status") != "ok":
            out.append(f"{name}: skipped — {res.get('note', '')}")
            continue
        bd = res["trace_cost"]["breakdown"]["fraction_of_total"]
        top = sorted(((v, k) for k, v in bd.items() if not k.startswith("assembly: ")), reverse=True)[:3]
        copies = bd.get("assembly: copies into the stored arrays, coordinates, attrs, Dataset", 0.0)
        out.append(f"{name}: trace() time goes to " + ", ".join(f"{k} {v * 100:.0f} %" for v, k in top)
                   + f" (copying the gradients and activations into the stored arrays, with the Dataset "
                   f"construction, {copies * 100:.0f} %).")
        gal = res["gallery"]["vc_gallery"]
        if gal.get("cpu_median_s") is not None and gal["median_s"] > 1.2 * gal["cpu_median_s"]:
            out.append(f"{name}: vc.gallery() took {gal['median_s'] * 1e3:.0f} ms of wall time but "
                       f"{gal['cpu_median_s'] * 1e3:.0f} ms of CPU time: the rest was waiting for a core on "
                       "this busy machine.")
        ag = res["gallery"]["agreement"]
        worst = max(v["max_abs_diff"] for v in ag.values())
        out.append(f"{name}: every peer map was compared with vitcam_nb's map of the same variant; the largest "
                   f"absolute difference on [0, 1] maps is {worst:.1e} (pytorch-grad-cam resizes with OpenCV, "
                   "vitcam_nb and torchcam with torch's bilinear rule).")
    for row in results.get("targets", []):
        cpu = row.get("cpu_value")
        if cpu and row["target"] != "gallery_seconds" and max(cpu, row["value"]) > 1.5 * min(cpu, row["value"]):
            fmt = "{:,.0f}" if min(cpu, row["value"]) >= 100 else "{:.3f}"
            out.append(f"{row['model']}: {row['what']} is {fmt.format(row['value'])}× in wall time but "
                       f"{fmt.format(cpu)}× in "
                       "CPU time. On a busy machine a sub-millisecond call usually runs within one scheduler slice "
                       "while a seconds-long one waits for a core about half the time, so wall-time ratios "
                       "between very short and very long calls are inflated; the CPU-time figure is the "
                       "conservative one.")
    wl = results["widget_latency"]
    if wl["status"] != "ok":
        out.append(f"Widget latency (item 5): {wl['status']} — {wl.get('note', '')}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.report RESULTS.json [OUT.md]``: re-render the markdown report from a JSON file."""
    import json
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m benchmarks.report RESULTS.json [OUT.md]", file=sys.stderr)
        return 2
    results = json.loads(Path(args[0]).read_text())
    results["notes"] = notes(results)  # recomputed, so a re-render picks up this version's wording
    text = markdown(results)
    if len(args) > 1:
        Path(args[1]).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
