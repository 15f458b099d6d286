"""vitcam_nb: Grad-CAM for Vision Transformers, honestly.

Trace a model once (:func:`trace`), recompute any variant of the Grad-CAM taxonomy from the trace
instantly (:func:`cam`, :func:`gallery`), each map carrying its recipe and reporting checklist.

The package is layered (``docs/architecture.md``): core, model, capture, compute, analysis, face. This
module is the face: it names the public API. The names are imported when one is first used (PEP 562), so that
``import vitcam_nb`` and ``vitcam-nb --help`` do not pay for torch or timm: the first use imports what
``import vitcam_nb`` used to (every ``vc.*`` attribute path that worked then works); the layer that registers the
computations (:mod:`vitcam_nb.compute`) is imported before any registry is first read, by whatever route.

Example:
    >>> import vitcam_nb as vc
    >>> r = vc.Recipe(site="F1", layer=-1)
    >>> r.site
    'F1'
"""

import importlib as _importlib
import typing as _typing

from vitcam_nb.core import registry as _registry
from vitcam_nb.core import rules as _rules
from vitcam_nb.core.errors import (
    ArgumentError,
    ArgumentIndexError,
    ArgumentTypeError,
    DegenerateMapWarning,
    ExportError,
    OutputExistsError,
    RandomWeightsWarning,
    RecipeError,
    TraceError,
    TraceFileError,
    VitcamError,
    WeightsError,
)
from vitcam_nb.core.version import __version__

# The registries of core (weightings, trace kinds) are filled by compute: imported on their first use.
_registry.fill_from("vitcam_nb.compute")
# The backward rules are modules of the capture layer, each stating its name and text in core's table.
_rules.fill_rules_from("vitcam_nb.capture.rules")
# Importing core above bound vc.core; unbound again, so that its first use goes through __getattr__ and finds the
# modules (vc.core.provenance, ...) that the first use imports.
globals().pop("core", None)

if _typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and the API reference generator
    from vitcam_nb import (  # noqa: F401  (vc.api, vc.capture, ... as names: the modules they were)
        adapters,
        api,
        audit,
        capture,
        compute,
        core,
        data,
        evaluate,
        interop,
        models,
        plot,
        preprocess,
        presets,
        stages,
        targets,
        widgets,
    )
    from vitcam_nb.api import cam, gallery
    from vitcam_nb.capture.budget import estimate
    from vitcam_nb.capture.io import load, save
    from vitcam_nb.capture.reader import image_choices, image_trace, open_traces
    from vitcam_nb.capture.scoring_many import score
    from vitcam_nb.capture.trace import trace
    from vitcam_nb.capture.trace_many import trace_many
    from vitcam_nb.compute.many import cam_many
    from vitcam_nb.compute.map_many import map_many
    from vitcam_nb.compute.map_store import image_maps, open_maps
    from vitcam_nb.core.checklist import Checklist
    from vitcam_nb.core.recipe import Recipe
    from vitcam_nb.evaluate.agreement.atlas import atlas_many
    from vitcam_nb.evaluate.ambiguity.analysis import ambiguity
    from vitcam_nb.models import list_models, load_model, sample_image
    from vitcam_nb.widgets import Compare, Explorer, Gallery
    from vitcam_nb.widgets.standalone import export_html

__all__ = [
    "VitcamError",
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentIndexError",
    "DegenerateMapWarning",
    "ExportError",
    "OutputExistsError",
    "RandomWeightsWarning",
    "WeightsError",
    "RecipeError",
    "TraceError",
    "TraceFileError",
    "estimate",
    "Checklist",
    "Compare",
    "Explorer",
    "export_html",
    "Gallery",
    "Recipe",
    "cam",
    "data",
    "evaluate",
    "interop",
    "list_models",
    "load_model",
    "sample_image",
    "gallery",
    "plot",
    "presets",
    "adapters",
    "stages",
    "targets",
    "__version__",
    "load",
    "save",
    "score",
    "trace",
    "ambiguity",
    "audit",
    "atlas_many",
    "cam_many",
    "image_choices",
    "image_trace",
    "image_maps",
    "map_many",
    "open_maps",
    "open_traces",
    "trace_many",
]

#: Each lazy function or class: the module it is imported from (``vc.NAME`` is ``MODULE.NAME``).
_OBJECTS = {
    "cam": "vitcam_nb.api", "gallery": "vitcam_nb.api",
    "estimate": "vitcam_nb.capture.budget",
    "load": "vitcam_nb.capture.io", "save": "vitcam_nb.capture.io",
    "image_choices": "vitcam_nb.capture.reader", "image_trace": "vitcam_nb.capture.reader",
    "open_traces": "vitcam_nb.capture.reader",
    "score": "vitcam_nb.capture.scoring_many",
    "trace": "vitcam_nb.capture.trace",
    "trace_many": "vitcam_nb.capture.trace_many",
    "cam_many": "vitcam_nb.compute.many",
    "map_many": "vitcam_nb.compute.map_many",
    "image_maps": "vitcam_nb.compute.map_store", "open_maps": "vitcam_nb.compute.map_store",
    "Checklist": "vitcam_nb.core.checklist",
    "Recipe": "vitcam_nb.core.recipe",
    "atlas_many": "vitcam_nb.evaluate.agreement.atlas",
    "ambiguity": "vitcam_nb.evaluate.ambiguity.analysis",
    "list_models": "vitcam_nb.models", "load_model": "vitcam_nb.models", "sample_image": "vitcam_nb.models",
    # The widget classes bring anywidget (with ipywidgets and IPython): imported when one is first named.
    "Compare": "vitcam_nb.widgets", "Explorer": "vitcam_nb.widgets", "Gallery": "vitcam_nb.widgets",
    "export_html": "vitcam_nb.widgets.standalone",
}
#: The subpackages and modules that ``vc.NAME`` names (every one that ``import vitcam_nb`` used to import).
_MODULES = ("adapters", "api", "audit", "capture", "compute", "core", "data", "evaluate", "interop", "models",
            "plot", "preprocess", "presets", "stages", "targets", "widgets")
#: What ``import vitcam_nb`` imported before it was lazy (the widget classes' anywidget excepted, as then): imported
#: at the first use of any lazy name, so that attribute paths through submodules (``vc.core.provenance``,
#: ``vc.widgets.standalone``) resolve as they did.
_EAGER = ("adapters", "audit", "compute", "data", "evaluate", "interop", "plot", "preprocess", "presets", "stages",
          "targets", "widgets", "api", "capture.budget", "capture.io", "capture.reader", "capture.scoring_many",
          "capture.trace", "capture.trace_many", "compute.many", "compute.map_many", "compute.map_store",
          "core.checklist", "core.recipe", "evaluate.agreement.atlas", "evaluate.ambiguity.analysis", "models",
          "widgets.standalone")


def _import_all() -> None:
    for module in _EAGER:
        _importlib.import_module(f"{__name__}.{module}")


def __getattr__(name: str) -> object:
    if name in _OBJECTS or name in _MODULES:
        _import_all()
    if name in _OBJECTS:
        value = getattr(_importlib.import_module(_OBJECTS[name]), name)
    elif name in _MODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once resolved, a plain attribute: no second lookup
    return value


def __dir__() -> list[str]:
    # The public names, resolved or not, and the module's own dunders; no private helpers, no TYPE_CHECKING.
    dunders = {n for n in globals() if n.startswith("__") and n.endswith("__")}
    return sorted({*__all__, *_OBJECTS, *_MODULES, *dunders})
