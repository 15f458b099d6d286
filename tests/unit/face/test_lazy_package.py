"""``import vitcam_nb`` is lazy (issue #51, item 6): it imports no torch, timm, transformers or matplotlib, every name
of the public surface it had when it imported everything eagerly still resolves to the same object, ``dir()`` lists
them and no import helper, and the registries compute fills are full whichever module is imported first. Each check
runs in a fresh interpreter, so that what an earlier test imported cannot hide an eager import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The public surface of vitcam_nb 0.2.0 as it was when __init__ imported everything, generated from that version with
# ``{n: getattr(vc, n).__module__ (or .__name__ for a module) for n in dir(vc)}`` (private and typing names left out).
OLD_MODULES = ["adapters", "api", "audit", "capture", "compute", "core", "data", "evaluate", "interop", "models",
               "plot", "preprocess", "presets", "stages", "targets", "widgets"]
OLD_OBJECTS = {
    "ArgumentError": "vitcam_nb.core.errors", "ArgumentIndexError": "vitcam_nb.core.errors",
    "ArgumentTypeError": "vitcam_nb.core.errors", "Checklist": "vitcam_nb.core.checklist",
    "Compare": "vitcam_nb.widgets.compare", "DegenerateMapWarning": "vitcam_nb.core.errors",
    "Explorer": "vitcam_nb.widgets.explorer", "ExportError": "vitcam_nb.core.errors",
    "Gallery": "vitcam_nb.widgets.gallery", "OutputExistsError": "vitcam_nb.core.errors",
    "RandomWeightsWarning": "vitcam_nb.core.errors", "Recipe": "vitcam_nb.core.recipe",
    "RecipeError": "vitcam_nb.core.errors", "TraceError": "vitcam_nb.core.errors",
    "TraceFileError": "vitcam_nb.core.errors", "VitcamError": "vitcam_nb.core.errors",
    "WeightsError": "vitcam_nb.core.errors", "ambiguity": "vitcam_nb.evaluate.ambiguity.analysis",
    "atlas_many": "vitcam_nb.evaluate.agreement.atlas", "cam": "vitcam_nb.api", "cam_many": "vitcam_nb.compute.many",
    "estimate": "vitcam_nb.capture.budget", "export_html": "vitcam_nb.widgets.standalone", "gallery": "vitcam_nb.api",
    "image_choices": "vitcam_nb.capture.reader", "image_maps": "vitcam_nb.compute.map_store",
    "image_trace": "vitcam_nb.capture.reader", "list_models": "vitcam_nb.models", "load": "vitcam_nb.capture.io",
    "load_model": "vitcam_nb.models", "map_many": "vitcam_nb.compute.map_many",
    "open_maps": "vitcam_nb.compute.map_store",
    "open_traces": "vitcam_nb.capture.reader", "sample_image": "vitcam_nb.models", "save": "vitcam_nb.capture.io",
    "score": "vitcam_nb.capture.scoring_many", "trace": "vitcam_nb.capture.trace",
    "trace_many": "vitcam_nb.capture.trace_many",
}
OLD_ALL = ["VitcamError", "ArgumentError", "ArgumentTypeError", "ArgumentIndexError", "DegenerateMapWarning",
           "ExportError", "OutputExistsError", "RandomWeightsWarning", "WeightsError", "RecipeError", "TraceError",
           "TraceFileError", "estimate", "Checklist", "Compare", "Explorer", "export_html", "Gallery", "Recipe", "cam",
           "data", "evaluate", "interop", "list_models", "load_model", "sample_image", "gallery", "plot", "presets",
           "adapters", "stages", "targets", "__version__", "load", "save", "score", "trace", "ambiguity", "audit",
           "atlas_many", "cam_many", "image_choices", "image_trace", "image_maps", "map_many", "open_maps",
           "open_traces", "trace_many"]
HEAVY = ("torch", "timm", "transformers", "matplotlib", "xarray", "anywidget")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_vitcam_nb_imports_no_heavy_library():
    loaded = json.loads(_run("import sys, json, vitcam_nb\n"
                             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"))
    assert loaded == []


def test_every_old_public_name_resolves_to_the_object_it_named_and_dir_lists_it():
    code = (f"import importlib, json, vitcam_nb as vc\nobjects, modules = {OLD_OBJECTS!r}, {OLD_MODULES!r}\n"
            "names = set(dir(vc))\n"
            "wrong = [n for n, m in objects.items() if getattr(vc, n) is not getattr(importlib.import_module(m), n)]\n"
            "wrong += [n for n in modules if getattr(vc, n) is not importlib.import_module('vitcam_nb.' + n)]\n"
            f"print(json.dumps({{'wrong': wrong, 'all': vc.__all__, 'dir': sorted(names), 'version': vc.__version__,\n"
            "                  'dir_after': sorted(dir(vc))}))")
    got = json.loads(_run(code))
    assert got["wrong"] == []
    assert got["all"] == OLD_ALL
    for listing in (got["dir"], got["dir_after"]):  # before and after the names were resolved
        assert set(OLD_OBJECTS) | set(OLD_MODULES) | {"__version__"} <= set(listing)
        assert "TYPE_CHECKING" not in listing and "annotations" not in listing
        assert not [n for n in listing if n.startswith("_") and not n.startswith("__")], listing
    assert got["version"].count(".") == 2


def test_attribute_paths_through_submodules_resolve_as_when_everything_was_imported():
    # Paths the tests and notebooks use: the eager import loaded each submodule, and now the first use does.
    out = _run("import vitcam_nb as vc\n"
               "got = [vc.core.provenance.weights_origin, vc.widgets.standalone.explorer_html, "
               "vc.compute.spatial.upsample]\n"
               "from vitcam_nb.core.provenance import weights_origin\n"
               "from vitcam_nb.widgets.standalone import explorer_html\n"
               "from vitcam_nb.compute.spatial import upsample\n"
               "print(*[a is b for a, b in zip(got, [weights_origin, explorer_html, upsample], strict=True)])")
    assert out.split() == ["True", "True", "True"]


def test_a_misspelt_name_is_an_attribute_error_naming_it():
    _run("import vitcam_nb as vc\n"
         "try:\n    vc.trcae\nexcept AttributeError as e:\n    assert 'trcae' in str(e)\n"
         "else:\n    raise AssertionError('a misspelt name resolved')\n")


@pytest.mark.parametrize("first", ["from vitcam_nb.core.weighting import weighting_names as f",
                                   "from vitcam_nb.core.recipe import Recipe; f = lambda: Recipe(weighting='layercam')",
                                   "from vitcam_nb.core.kinds import TRACE_KINDS; f = TRACE_KINDS.names"])
def test_the_built_in_weightings_and_kinds_are_registered_whichever_module_comes_first(first):
    # The built-ins that vitcam_nb.compute registers: found (and first) although nothing imported compute.
    out = _run(f"{first}\nf()\nfrom vitcam_nb.core.weighting import weighting_names\n"
               "from vitcam_nb.core.kinds import TRACE_KINDS\n"
               "print(weighting_names()[0], 'layercam' in weighting_names(), len(TRACE_KINDS) > 3)")
    assert out.split() == ["gradcam", "True", "True"]
