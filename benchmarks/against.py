"""vitcam_nb against a base commit, side by side in one run: trace, one variant and gallery.

``python -m benchmarks.against --base e4ec999 [--model vit_base_patch16_224] [--rounds 5] [--threads 1]
[--quick] [--out benchmarks/AGAINST.json]``

The base commit's tree is extracted into a temporary folder (``git archive``, so the working tree and git's
worktree list stay untouched). Each round runs ``benchmarks/against_worker.py`` once per version, each in a
fresh process with ``PYTHONPATH`` pointing at that version's tree, the order alternating every round
(base, new / new, base, ...). A ratio is new/base, the median of the per-round ratios: two runs measured back
to back under the same load compare far better on a shared machine than absolute times do. The target is
``ratio <= 1.10`` for every item.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import machine as host
from benchmarks.timing import paired_ratio

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "against_worker.py"
DEFAULT_OUT = Path(__file__).resolve().parent / "AGAINST.json"
# --quick is a smoke test: it must not overwrite the committed full-run file that the README is built from.
QUICK_OUT = Path(__file__).resolve().parent / "results" / "against-quick.json"
ITEMS = {"trace": "trace", "one_variant": "one variant", "gallery": "gallery"}
THRESHOLD = 1.10
VERSIONS = ("base", "new")
BLAS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
            "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


class MissingCommit(ValueError):
    """The base revision is not a commit of this repository (a shallow clone, a typo, or no git)."""


@dataclass
class Settings:
    """What to run. ``blas_threads`` caps numpy's BLAS pool in the workers (0: leave the library default)."""

    base: str = "e4ec999"
    model: str = "vit_base_patch16_224"
    rounds: int = 5
    threads: int = 1
    blas_threads: int = 1
    trace_calls: int = 5
    cam_burst: int = 20
    gallery_calls: int = 5
    quick: bool = False
    out: Path = DEFAULT_OUT
    command: str = "python -m benchmarks.against"
    worker_timeout_s: float = 1800.0
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True), repr=False)


def parse_args(argv: list[str] | None = None) -> Settings:
    """Turn the command line into :class:`Settings`; ``--quick`` changes the defaults, explicit options win.

    Example:
        >>> s = parse_args(["--quick"])
        >>> s.model, s.rounds, s.out.name
        ('vit_tiny_patch16_224', 2, 'against-quick.json')
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.against", description=__doc__.split("\n")[0])
    p.add_argument("--base", default="e4ec999", help="commit (or any git revision) to compare against")
    p.add_argument("--model", default=None, help="timm model, random init (default vit_base_patch16_224; "
                   "quick: vit_tiny_patch16_224)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads in the workers (default 1; 0: torch's choice)")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS etc. in the workers (default: same as --threads; 0 leaves the "
                        "library default, which on a busy machine makes numpy's small matrix products erratic)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: tiny ViT, 2 rounds, fewer calls, no claims")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default benchmarks/AGAINST.json; quick: benchmarks/results/against-quick.json)")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    quick = args.quick
    return Settings(
        base=args.base,
        model=args.model or ("vit_tiny_patch16_224" if quick else "vit_base_patch16_224"),
        rounds=args.rounds or (2 if quick else 5),
        threads=args.threads,
        blas_threads=args.threads if args.blas_threads is None else args.blas_threads,
        trace_calls=2 if quick else 5,
        cam_burst=5 if quick else 20,
        gallery_calls=2 if quick else 5,
        quick=quick,
        out=args.out or (QUICK_OUT if quick else DEFAULT_OUT),
        command="python -m benchmarks.against" + ("" if not argv else " " + shlex.join(argv)),
    )


# -- git ----------------------------------------------------------------------------------------------------
def _git(*args: str, repo: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def resolve_commit(ref: str, repo: Path = ROOT) -> str:
    """Full hash of the commit ``ref`` names; :class:`MissingCommit` if the repository does not have it (shallow clone).

    Example:
        >>> len(resolve_commit("HEAD"))  # doctest: +SKIP
        40
    """
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", repo=repo)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise MissingCommit(f"{ref!r} is not a commit of {repo} (shallow clone, or git missing?)") from exc


def extract_tree(commit: str, dest: Path, repo: Path = ROOT) -> None:
    """Write the files of ``commit`` under ``dest`` with ``git archive``; no worktree, index or ref changes.

    Example:
        >>> extract_tree(resolve_commit("HEAD"), Path(tempfile.mkdtemp()))  # doctest: +SKIP
    """
    proc = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            # The "data" filter (Python >= 3.10.12 / 3.11.4) refuses absolute paths and links out of dest.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)
    finally:
        err = proc.communicate()[1]
    if proc.returncode != 0:
        raise RuntimeError(f"git archive {commit} failed: {err.decode(errors='replace').strip()}")


def working_tree_state(repo: Path = ROOT) -> dict:
    """HEAD of the current checkout and whether ``vitcam_nb/`` has uncommitted changes (measured as they are).

    Example:
        >>> sorted(working_tree_state())  # doctest: +SKIP
        ['commit', 'vitcam_nb_dirty']
    """
    return {"commit": _git("rev-parse", "HEAD", repo=repo),
            "vitcam_nb_dirty": bool(_git("status", "--porcelain", "--", "vitcam_nb", repo=repo))}


# -- one worker run ------------------------------------------------------------------------------------------
def worker_env(tree: Path, blas_threads: int) -> dict[str, str]:
    """Environment for a worker measuring ``tree``: its root first on PYTHONPATH (ahead of the editable
    install of the current checkout) and, if ``blas_threads``, the BLAS/OpenMP pools capped.

    Example:
        >>> worker_env(Path("/t"), 1)["PYTHONPATH"].split(os.pathsep)[0], worker_env(Path("/t"), 1)["OMP_NUM_THREADS"]
        ('/t', '1')
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    for name in BLAS_ENV:
        if blas_threads:
            env[name] = str(blas_threads)
    return env


def run_worker(tree: Path, s: Settings) -> dict:
    """Measure the vitcam_nb of ``tree`` in a fresh process; returns the worker's JSON report.

    Example:
        >>> run_worker(ROOT, parse_args(["--quick"]))["items"]["trace"]["median_s"] > 0  # doctest: +SKIP
        True
    """
    cmd = [sys.executable, str(WORKER), "--root", str(tree), "--model", s.model, "--threads", str(s.threads),
           "--trace-calls", str(s.trace_calls), "--cam-burst", str(s.cam_burst),
           "--gallery-calls", str(s.gallery_calls)]
    # cwd is the measured tree, so that neither the current checkout's folder nor its benchmarks package is
    # reachable through the working directory.
    proc = subprocess.run(cmd, cwd=tree, env=worker_env(tree, s.blas_threads), capture_output=True, text=True,
                          timeout=s.worker_timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or "error" in report or "items" not in report:
        detail = report.get("error") or proc.stderr[-3000:] or proc.stdout[-3000:]
        raise RuntimeError(f"worker for {tree} failed (exit {proc.returncode}): {detail}")
    return report


# -- summary -------------------------------------------------------------------------------------------------
def summarise(rounds: list[dict]) -> dict:
    """Per item: each version's per-round medians and their median, and new/base as the median of the
    per-round ratios (wall and CPU time), with whether it is within :data:`THRESHOLD`.

    Example:
        >>> r = [{v: {"items": {i: {"median_s": t, "cpu_median_s": t} for i in ITEMS}} for v, t in
        ...       (("base", 1.0), ("new", 1.05))}] * 3
        >>> s = summarise(r)["gallery"]
        >>> round(s["ratio"], 2), s["holds"]
        (1.05, True)
    """
    out = {}
    for item in ITEMS:
        wall = {v: [r[v]["items"][item]["median_s"] for r in rounds] for v in VERSIONS}
        cpu = {v: [r[v]["items"][item]["cpu_median_s"] for r in rounds] for v in VERSIONS}
        ratio = paired_ratio(wall["new"], wall["base"])
        out[item] = {
            **{v: {"median_s": statistics.median(wall[v]), "rounds_s": [round(t, 6) for t in wall[v]],
                   "cpu_median_s": statistics.median(cpu[v])} for v in VERSIONS},
            "ratio": ratio,
            "ratios": [round(a / b, 4) for a, b in zip(wall["new"], wall["base"])],
            "cpu_ratio": paired_ratio(cpu["new"], cpu["base"]),
            "ratio_of_medians": statistics.median(wall["new"]) / statistics.median(wall["base"]),
            "holds": ratio <= THRESHOLD,
        }
    return out


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def markdown(result: dict) -> str:
    """A short table: each item's base and new medians, the ratio (wall and CPU) and the verdict.

    Example:
        >>> r = [{v: {"items": {i: {"median_s": 0.5, "cpu_median_s": 0.5} for i in ITEMS}} for v in VERSIONS}]
        >>> print(markdown({"items": summarise(r), "base": {"ref": "abc"}, "model": "m", "settings":
        ...                 {"threads": 1, "rounds": 1}, "verdict": "holds"}).splitlines()[2])
        | item | base (median) | new (median) | new/base | same from CPU time | <= 1.10 |
    """
    lines = [f"vitcam_nb against {result['base']['ref']} on {result['model']}, "
             f"{result['settings']['threads']} thread(s), {result['settings']['rounds']} interleaved rounds:",
             "",
             "| item | base (median) | new (median) | new/base | same from CPU time | <= 1.10 |",
             "|---|---|---|---|---|---|"]
    for item, label in ITEMS.items():
        it = result["items"][item]
        lines.append(f"| {label} | {_fmt_s(it['base']['median_s'])} | {_fmt_s(it['new']['median_s'])} | "
                     f"{it['ratio']:.3f}× | {it['cpu_ratio']:.3f}× | {'yes' if it['holds'] else 'no'} |")
    lines += ["", f"Verdict: {result['verdict']} (ratios are medians of per-round new/base ratios)."]
    return "\n".join(lines) + "\n"


# -- the run -------------------------------------------------------------------------------------------------
def run(s: Settings) -> dict:
    """Extract the base tree, run the interleaved rounds, write ``s.out`` and return the results dict.

    Example:
        >>> result = run(parse_args(["--quick", "--out", "/tmp/a.json"]))  # doctest: +SKIP
        >>> result["verdict"] in ("holds", "does not hold")  # doctest: +SKIP
        True
    """
    started = time.perf_counter()
    commit = resolve_commit(s.base)
    machine = host.machine_info("cpu")
    tmp = Path(tempfile.mkdtemp(prefix="vitcam-against-"))
    trees = {"base": tmp, "new": ROOT}
    rounds: list[dict] = []
    try:
        extract_tree(commit, tmp)
        s.log(f"vitcam_nb against {s.base} ({commit[:12]}) on {s.model}, {s.rounds} rounds, "
              f"{s.threads} thread(s); base tree in {tmp}; load average {machine['load_average_start']}")
        for r in range(s.rounds):
            order = VERSIONS if r % 2 == 0 else VERSIONS[::-1]
            this: dict = {"order": list(order)}
            for version in order:
                this[version] = run_worker(trees[version], s)
                t = this[version]["items"]
                s.log(f"  round {r + 1}/{s.rounds} {version:4s}: trace {_fmt_s(t['trace']['median_s'])}, "
                      f"one variant {_fmt_s(t['one_variant']['median_s'])}, "
                      f"gallery {_fmt_s(t['gallery']['median_s'])}")
            rounds.append(this)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    items = summarise(rounds)
    first = rounds[0]
    # Evidence that each side imported its own tree although the current checkout's editable finder was there.
    imports = {v: {"editable_finder_on_meta_path": first[v]["editable_finder_on_meta_path"],
                   "modules_outside_root": sorted({m for r in rounds for m in r[v]["modules_outside_root"]})}
               for v in VERSIONS}
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    # The parent never runs torch: the threads that count are the workers'.
    machine["torch_threads"] = first["new"]["torch_threads"]
    machine["blas_threads"] = s.blas_threads or "library default"
    versions = host.versions()
    versions["vitcam_nb"] = {v: first[v]["versions"]["vitcam_nb"] for v in VERSIONS}
    holds = all(it["holds"] for it in items.values())
    result = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": s.command,
        "quick": s.quick,
        "model": s.model,
        "base": {"ref": s.base, "commit": commit, "tree": str(tmp), "vitcam_nb_file": first["base"]["vitcam_nb_file"],
                 "version": first["base"]["versions"]["vitcam_nb"], **imports["base"]},
        "new": {**working_tree_state(), "tree": str(ROOT), "vitcam_nb_file": first["new"]["vitcam_nb_file"],
                "version": first["new"]["versions"]["vitcam_nb"], **imports["new"]},
        "machine": machine,
        "versions": versions,
        "settings": {k: v for k, v in asdict(s).items() if k not in ("out", "command", "log", "quick")}
                    | {"targets": "top5", "cam_recipe": "presets.pytorch_grad_cam_vit()",
                       "gallery": "vc.gallery(tr, vc.Recipe(), vary={'layer': 'all', "
                                  "'site': ['F1', 'F3', 'F4', 'F5', 'F6']})",
                       "gallery_recipe_is_preset": first["new"]["gallery_recipe_is_preset"]},
        "threshold": THRESHOLD,
        "items": items,
        "holds": holds,
        "verdict": "holds" if holds else "does not hold",
        "rounds": rounds,
        "wall_s": time.perf_counter() - started,
    }
    s.out.parent.mkdir(parents=True, exist_ok=True)
    s.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    s.log(f"done in {result['wall_s']:.0f} s; wrote {s.out}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its table; exit 2 if the base commit is missing.

    Example:
        >>> main(["--base", "no-such-commit", "--quick"])  # doctest: +SKIP
        2
    """
    s = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(s)
    except MissingCommit as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
