"""Layer 4, compute: from a trace to maps with no model call. The trace view, the weighting kernels, the
per-layer pipeline, layer fusion, the checklist and methods text, and one module per trace kind (flat,
stages, cross-attention, many images), each registered in :data:`vitcam_nb.core.kinds.TRACE_KINDS`.

Importing this package registers the built-in kernels and kinds.
"""

# Each registers itself.
from vitcam_nb.compute import flat, kernels, many, published, relevance  # noqa: F401, I001
from vitcam_nb.compute import chefer, stages, tokentm, video, vitcx, vlm, xattn  # noqa: F401, I001

# Last, so that it is looked up first: a map store's image is a Dataset other kinds would take for a trace.
from vitcam_nb.compute import map_store  # noqa: F401, E402
