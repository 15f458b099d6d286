"""Bundled known-answer data: the synthetic shapes generator (models live in ``vitcam_nb.models``)."""

from .shapes import CLASS_NAMES, MEAN, NUM_CLASSES, STD, shapes

__all__ = ["CLASS_NAMES", "MEAN", "NUM_CLASSES", "STD", "shapes"]
