"""vitcam_nb: Grad-CAM for Vision Transformers, honestly.

Trace a model once (:func:`trace`), recompute any variant of the Grad-CAM taxonomy from the trace
instantly (:func:`cam`, :func:`gallery`), each map carrying its recipe and reporting checklist.

The package is layered (``docs/architecture.md``): core, model, capture, compute, analysis, face. This
module is the face: it names the public API and imports the layer that registers the computations.

Example:
    >>> import vitcam_nb as vc
    >>> r = vc.Recipe(site="F1", layer=-1)
    >>> r.site
    'F1'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# compute registers the weighting kernels and trace kinds; preprocess is vc.preprocess (used in the notebooks).
from vitcam_nb import (  # noqa: F401
    adapters,
    audit,
    compute,
    data,
    evaluate,
    interop,
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
from vitcam_nb.core import checklist_check as _checklist_check  # noqa: F401  (registers Checklist.from_json's check)
from vitcam_nb.core.checklist import Checklist
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
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.version import __version__
from vitcam_nb.evaluate.agreement.atlas import atlas_many
from vitcam_nb.evaluate.ambiguity.analysis import ambiguity
from vitcam_nb.models import list_models, load_model, sample_image
from vitcam_nb.widgets.standalone import export_html

if TYPE_CHECKING:
    from vitcam_nb.widgets import Compare, Explorer, Gallery

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

#: The widget classes, imported from :mod:`vitcam_nb.widgets` when first named (they bring anywidget).
_WIDGETS = ("Compare", "Explorer", "Gallery")


def __getattr__(name: str) -> type:
    if name in _WIDGETS:
        return getattr(widgets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WIDGETS})
