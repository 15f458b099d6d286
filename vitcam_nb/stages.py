"""``vitcam_nb.stages`` (``vc.stages``): what a user needs from a hierarchical (Swin) trace beyond ``vc.cam``
— one stage as a flat trace, global block indices, the dense form of window attention. The hierarchical trace
kind lives in :mod:`vitcam_nb.compute.stages`; this module keeps the public path.

Example:
    >>> from vitcam_nb import stages
    >>> callable(stages.stage_dataset)
    True
"""

from vitcam_nb.compute.stages import global_layer, stage_dataset, window_to_dense

__all__ = ["global_layer", "stage_dataset", "window_to_dense"]
