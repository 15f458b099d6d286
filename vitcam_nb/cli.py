"""The ``vitcam-nb`` command.

The parser is built and the arguments read before anything heavy is imported (torch, timm, matplotlib), so that
``--help`` and a mistyped argument answer at once; ``--model`` and ``--image`` are checked before any progress bar or
model build (:func:`vitcam_nb.core.model_names.check_model`).
"""

from __future__ import annotations

import argparse
import json
import sys

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.model_names import bundled_model_names, check_model

__all__ = ["bundled_model_names", "check_model", "main"]

_MODEL_HELP = ("a bundled model name (vitcam-nb models lists them; their weights ship with the package) or a timm "
               "model name, which needs --image PATH")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vitcam-nb``; ``vitcam-nb demo`` is the main job.

    Example:
        >>> main(["--help"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(prog="vitcam-nb", description="Grad-CAM for Vision Transformers, honestly.",
                                     epilog="--model takes a bundled model name (vitcam-nb models lists them, each "
                                            "with its sample images) or a timm model name, which needs --image PATH.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="trace a model on an image and write a gallery, atlas and HTML report")
    demo.add_argument("--out", default="vitcam-demo", help="output folder (default: vitcam-demo)")
    demo.add_argument("--model", default="shapes-vit",
                      help=f"{_MODEL_HELP} (default: shapes-vit; shapes-video: the video demo on a generated clip; "
                           "shapes-yolos: the detection demo on a generated image; shapes-vlm: the VLM demo, a "
                           "generated question and the maps of the generated answer)")
    demo.add_argument("--image", default=None,
                      help="image file (default: a bundled sample image; needed for a timm model)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace outputs in --out that this command did not write (or that changed since)")
    _weights_arguments(demo)
    sub.add_parser("models", help="list the bundled models (their weights ship with the package)")
    amb = sub.add_parser("ambiguity", help="how much a reported Grad-CAM description leaves open: figure and JSON")
    amb.add_argument("--model", default="shapes-vit", help=f"{_MODEL_HELP} (default: shapes-vit)")
    amb.add_argument("--reported", nargs="*", default=[], metavar="FIELD=VALUE",
                     help="what the description states, e.g. site=F1 layer=-1 (a category=open leaves it open)")
    amb.add_argument("--images", type=int, default=1, help="bundled sample images to analyse (default 1)")
    amb.add_argument("--image", default=None, help="image file (needed for a timm model)")
    amb.add_argument("--out", default="vitcam-ambiguity", help="output folder (default: vitcam-ambiguity)")
    amb.add_argument("--overwrite", action="store_true",
                     help="replace ambiguity.png / ambiguity.json in --out that this command did not write (or that "
                          "changed since)")
    _weights_arguments(amb)
    export = sub.add_parser("export", help="write a trace's Explorer as one self-contained HTML file")
    export.add_argument("trace", help="a trace file written by vc.save (netCDF or zarr)")
    export.add_argument("--out", default="explorer.html", help="the HTML file (default: explorer.html)")
    export.add_argument("--axes", action="append", default=[], metavar="FIELD=V1,V2",
                        help="values of a recipe field varied in the page (repeatable), e.g. site=F1,F6 layer=-1")
    export.add_argument("--quantize", default="uint8", choices=["uint8", "float16", "float32"],
                        help="how maps are stored (default: uint8)")
    export.add_argument("--max-mb", type=float, default=None, help="refuse to write a larger file")
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    export.add_argument("--overwrite", action="store_true",
                        help="replace a file at --out that is not a page this command wrote")
    cam = sub.add_parser("cam", help="regenerate one map from a trace file and a recipe line (Recipe.to_string)")
    cam.add_argument("trace", help="a trace file written by vc.save (netCDF or zarr)")
    cam.add_argument("recipe", help='the recipe as a line, e.g. "F1@11 logit gradcam" (missing fields: defaults)')
    cam.add_argument("--out", default="map.png", help="the picture of the map (default: map.png)")
    cam.add_argument("--overwrite", action="store_true", help="replace --out even if vitcam_nb did not write it")
    fig = sub.add_parser("figure", help="the audit's experiment: variants x images labelled localises / context / "
                                        "inverted / empty, as a figure and JSON")
    fig.add_argument("--out", default="vitcam-figure", help="output folder (default: vitcam-figure)")
    fig.add_argument("--model", default="auto",
                     help="auto (ViT-B/16 if its weights are on this machine, else shapes-vit), a bundled name or a "
                          "timm name with cached weights (default: auto); the figure uses its own images, no --image")
    source = fig.add_mutually_exclusive_group()
    source.add_argument("--pretrained", action="store_true",
                        help="the timm model with its published weights from the timm / Hugging Face cache (what a "
                             "timm name gets anyway); with --model auto: ViT-B/16, refused rather than falling back "
                             "to shapes-vit when its weights are not on this machine")
    source.add_argument("--weights", default=None, metavar="PATH",
                        help="a local safetensors weights file for the timm model (default: the cache)")
    fig.add_argument("--images", type=int, default=5, help="bundled shape images (default 5, one per class)")
    fig.add_argument("--no-photo", action="store_true", help="leave out the photograph (grace_hopper.jpg)")
    fig.add_argument("--axes", action="append", default=[], metavar="FIELD=V1,V2",
                     help="narrow an axis (repeatable), e.g. site=F1,F2 weighting=gradcam")
    fig.add_argument("--overwrite", action="store_true",
                     help="write into a folder holding other files (they are left alone) and replace "
                          "audit_figure.png / audit_figure.json there even if this command did not write them")
    fig.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.command == "export":
        return _export(args)
    if args.command == "cam":
        return _cam(args)
    if args.command == "figure":
        return _figure(args)

    if args.command == "models":
        from vitcam_nb.models import list_models

        print("weights: bundled with vitcam_nb (safetensors files checked against their cards' sha256)")
        for card in list_models():
            # A model whose class comes from an optional package says which extra installs it.
            needs = f"  (needs pip install -e '.[{card['extra']}]')" if card.get("extra") else ""
            print(f"{card['name']:24s} acc {card['test_accuracy']:.3f}  "
                  f"file sha256 {card['weights_file_sha256'][:12]}  {card['description']}{needs}")
        return 0
    if args.command == "ambiguity":
        try:
            check_model(args.model, args.image)
        except ArgumentError as exc:
            print(f"vitcam-nb ambiguity: {exc}", file=sys.stderr)
            return 2
        from vitcam_nb.audit import parse_reported_args, run_ambiguity

        try:
            paths = run_ambiguity(args.out, model=args.model, reported=parse_reported_args(args.reported),
                                  images=args.images, image=args.image, pretrained=args.pretrained,
                                  weights=args.weights, announce=_announce, overwrite=args.overwrite)
        except (ValueError, TypeError) as exc:
            print(f"vitcam-nb ambiguity: {exc}", file=sys.stderr)
            return 2
        print(json.loads(paths["summary"].read_text())["report"])
        print(f"vitcam-nb ambiguity wrote: {paths['figure']} {paths['summary']}")
        return 0
    try:
        check_model(args.model, args.image)
    except ArgumentError as exc:
        print(f"vitcam-nb demo: {exc}", file=sys.stderr)
        return 2
    from vitcam_nb.demo import run_demo

    try:
        paths = run_demo(args.out, model=args.model, image=args.image, progress=not args.quiet,
                         overwrite=args.overwrite, pretrained=args.pretrained, weights=args.weights,
                         announce=_announce)
    except (ValueError, TypeError) as exc:
        print(f"vitcam-nb demo: {exc}", file=sys.stderr)
        return 2
    print("vitcam-nb demo wrote:")
    for name, path in paths.items():
        print(f"  {name:8s} {path}")
    return 0


def _weights_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pretrained", action="store_true",
                        help="a timm model with its published weights, from the timm / Hugging Face cache "
                             "(default: random-init, with a warning)")
    source.add_argument("--weights", default=None, metavar="PATH",
                        help="a timm model with the weights of this safetensors file (its state dict)")


def _announce(line: str) -> None:
    """Print the weights' origin before any result; random-init says what that means. Through ``tqdm.write``: a bar
    that is already drawn is lifted and redrawn below the line, never written onto it."""
    from tqdm import tqdm

    if line == "weights: random-init":
        line += " (untrained: the maps explain no learned model; use --pretrained or --weights PATH)"
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _axes(items: list[str]) -> dict[str, list]:
    """``--axes FIELD=V1,V2`` options as a dict of values (numbers read as numbers)."""
    axes = {}
    for item in items:
        field, sep, values = item.partition("=")
        if not sep or not values:
            raise ArgumentError(f"--axes: expected FIELD=V1,V2, got {item!r}")
        axes[field.strip()] = [_value(v.strip()) for v in values.split(",")]
    return axes


def _export(args: argparse.Namespace) -> int:
    from vitcam_nb.capture.io import load
    from vitcam_nb.widgets.standalone import export_html

    try:
        axes = _axes(args.axes)
        tr = load(args.trace)
        export_html(tr, args.out, axes=axes or None, quantize=args.quantize, max_mb=args.max_mb,
                    progress=not args.quiet, overwrite=args.overwrite)
    except (ValueError, TypeError, OSError) as exc:  # TraceFileError is a ValueError
        print(f"vitcam-nb export: {exc}", file=sys.stderr)
        return 2
    return 0


_PNG_MARK = "vitcam_nb cam"


def _our_png(path: object) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return str(im.info.get("Software", "")).startswith(_PNG_MARK)
    except OSError:
        return False


def _cam(args: argparse.Namespace) -> int:
    """Regenerate a map: the recipe line, both ids, the trace id and the methods paragraph printed, the picture
    written (replacing only a picture this command wrote)."""
    from pathlib import Path

    import matplotlib.pyplot as plt

    from vitcam_nb import plot
    from vitcam_nb.api import cam
    from vitcam_nb.capture.io import load
    from vitcam_nb.core.outfiles import check_output, replacing
    from vitcam_nb.core.recipe import Recipe

    out = Path(args.out)
    try:
        recipe = Recipe.parse(args.recipe)
        check_output(out, overwrite=args.overwrite, ours=_our_png, what="map picture")
        tr = load(args.trace)
        m = cam(tr, recipe)
        fig = plot.overlay(tr, m)
        with replacing(out) as tmp:
            fig.savefig(tmp, dpi=100, format="png", metadata={"Software": f"{_PNG_MARK} {tr.attrs.get('trace_id')}"})
        plt.close(fig)
    except (ValueError, TypeError, OSError) as exc:  # RecipeError and TraceFileError are ValueErrors
        print(f"vitcam-nb cam: {exc}", file=sys.stderr)
        return 2
    resolved = recipe.resolve(tr)
    print(f"recipe:       {resolved.to_string()}")
    print(f"recipe id:    {recipe.id} (as written); canonical id {resolved.id}")
    print(f"trace:        {tr.attrs.get('trace_id')} ({tr.attrs.get('weights_origin', 'weights of unknown origin')})")
    print(f"methods:      {m.attrs.get('methods', '')}")
    print(f"vitcam-nb cam wrote: {out}")
    return 0


def _figure(args: argparse.Namespace) -> int:
    try:
        axes = _axes(args.axes)
        model = _figure_model(args.model, args.pretrained)
    except ArgumentError as exc:
        print(f"vitcam-nb figure: {exc}", file=sys.stderr)
        return 2
    from vitcam_nb.audit_figure import run_figure

    try:
        result = run_figure(args.out, model=model, images=args.images, photo=not args.no_photo,
                            axes=axes or None, weights=args.weights, overwrite=args.overwrite,
                            progress=not args.quiet)
    except (ValueError, TypeError, OSError) as exc:
        print(f"vitcam-nb figure: {exc}", file=sys.stderr)
        return 2
    summary = result["summary"]
    print(f"vitcam-nb figure {result['line']}.")
    print(f"  {summary['maps']} maps: " + ", ".join(f"{k} {v}" for k, v in summary["counts"].items()))
    print(f"  {summary['caveat']}")
    print(f"  wrote: {result['paths']['figure']} {result['paths']['summary']}")
    return 0


def _figure_model(model: str, pretrained: bool) -> str:
    """The model ``vitcam-nb figure`` runs: ``--pretrained`` makes ``auto`` ViT-B/16 with no fallback to the bundled
    model (a timm name already runs with its published weights) and is refused for a bundled name."""
    if model != "auto":
        kind = check_model(model, image_needed=False)
        if pretrained and kind == "bundled":
            raise ArgumentError(f"pretrained: the bundled model {model} carries its own weights; leave out "
                                "--pretrained")
        return model
    return "vit_base_patch16_224" if pretrained else model  # audit_figure.AUDIT_MODEL, named without importing it


if __name__ == "__main__":
    sys.exit(main())
