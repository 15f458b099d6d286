"""Many images: trace a dataset into one zarr store, open it lazily with dask, compute maps and atlases
chunk by chunk (DESIGN.md section 4, "Many images").

The store is the single-image trace schema with a leading ``image`` dimension, written with xarray + zarr
and chunked one image and one layer per chunk, so reading one layer of one image reads one chunk. Two
names differ from a single trace, because a dimension and a variable cannot share a name in xarray:

* the uint8 display copy of each input is ``pixels`` (image, y, x, rgb), not ``image``;
* the ``target`` dimension holds fixed positions (``top1`` .. ``topK`` for a top-K store, ``logit_<c>`` for
  explicit classes, then ``expected_logit``) and ``target_class`` / ``target_label`` are (image, target)
  coordinates, because each image has its own top-K classes.

Per-image facts that are attributes of a single trace (``trace_id``, ``input_sha256``, ``preprocessing``,
``device``, ``deterministic``) are (image,) coordinates, next to ``label`` (-1 when unknown) and ``source``
(file name, when known); the optional ground-truth ``mask`` is a (image, y, x) variable in the model's input
geometry. :func:`image_trace` turns one image of a store back into exactly the Dataset :func:`vitcam_nb.trace`
returns.

Writes are resumable: a ``done`` flag per image is written only after that image's data, every chunk and
metadata write of zarr's local store is atomic (temporary file, then rename), and the store records the
model, weights and settings it holds, so a rerun continues where it stopped and refuses anything else.
Only local (or shared-filesystem) paths are supported, and one writer at a time.
"""

from vitcam_nb.many.compute import atlas_many, cam_many
from vitcam_nb.many.store import image_choices, image_trace, open_traces, trace_many

__all__ = ["atlas_many", "cam_many", "image_choices", "image_trace", "open_traces", "trace_many"]
