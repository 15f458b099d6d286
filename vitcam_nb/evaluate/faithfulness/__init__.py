"""Faithfulness: what the model does when the map's evidence is removed or kept (deletion, insertion, ROAD, IROF,
faithfulness and monotonicity correlation, SaCo, sufficiency), on the perturbation and removal engines and their
substrates.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
