"""Layer 3, capture: the one place the model runs to be traced. The hook context, the single forward and
batched backward pass shared by :func:`vitcam_nb.trace` and :func:`vitcam_nb.trace_many`, assembly of flat,
staged and extra-site Datasets, saving and loading, and the zarr store of many images.

Imports only core and model (``docs/architecture.md``, "Layers").
"""
