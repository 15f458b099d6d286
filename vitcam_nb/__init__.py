"""vitcam_nb: Grad-CAM for Vision Transformers, honestly.

Trace a model once (:func:`trace`), recompute any variant of the Grad-CAM taxonomy from the trace
instantly (:func:`cam`, :func:`gallery`), each map carrying its recipe and reporting checklist.

Example:
    >>> import vitcam_nb as vc
    >>> r = vc.Recipe(site="F1", layer=-1)
    >>> r.site
    'F1'
"""

from __future__ import annotations

__version__ = "0.1.0"

from vitcam_nb import adapters, data, evaluate, plot, presets, stages, targets
from vitcam_nb.cam import cam, gallery
from vitcam_nb.errors import DegenerateMapWarning, RecipeError, TraceError, TraceFileError
from vitcam_nb.io import load, save
from vitcam_nb.many import atlas_many, cam_many, image_choices, image_trace, open_traces, trace_many
from vitcam_nb.models import list_models, load_model, sample_image
from vitcam_nb.taxonomy import Checklist, Recipe
from vitcam_nb.tracer import trace
from vitcam_nb.widgets import Compare, Explorer, Gallery

__all__ = [
    "DegenerateMapWarning",
    "RecipeError",
    "TraceError",
    "TraceFileError",
    "Checklist",
    "Compare",
    "Explorer",
    "Gallery",
    "Recipe",
    "cam",
    "data",
    "evaluate",
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
    "trace",
    "atlas_many",
    "cam_many",
    "image_choices",
    "image_trace",
    "open_traces",
    "trace_many",
]
