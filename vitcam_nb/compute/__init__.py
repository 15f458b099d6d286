"""Layer 4, compute: from a trace to maps with no model call. The trace view, the weighting kernels, the
per-layer pipeline, layer fusion, the checklist and methods text, and one module per trace form (flat,
stages, cross-attention, many images, ...), each registered in :data:`vitcam_nb.core.kinds.TRACE_FORMS`.

Importing this package imports every module of it (a walk of the package, sorted by name; names starting with
``_`` skipped), so a new trace form, like a new weighting, is one module with no import line to add. The lookup
order of the forms does not depend on import order: each form declares its ``priority`` when it registers
(smaller is asked first; the built-ins': map store 10, video 20, vitcx 30, tokentm 40, transformer_attribution 50,
published 60, tam 95, flat 100, many 110, stages 120, vlm 130, xattn 140). A form for traces the flat form would also
take declares a priority below 100.
"""

import importlib as _importlib
import pkgutil as _pkgutil

# The modules that register published-method weightings, imported first in the order they always were: the
# weighting registry lists in registration order (menus, sweeps, the paper-card schema's enum), and that order is
# kept as it was. Nothing else depends on it; every other module, and any new one, is found by the walk below.
_WEIGHTING_ORDER = ("flat", "kernels", "many", "published", "relevance", "chefer", "stages", "tokentm", "video",
                    "vitcx", "vlm", "xattn", "map_store")
_modules = [m.name for m in _pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
for _name in [n for n in _WEIGHTING_ORDER if n in _modules] + sorted(set(_modules) - set(_WEIGHTING_ORDER)):
    _importlib.import_module(f"{__name__}.{_name}")
