"""Localisation: a map against a ground-truth mask (pointing game, energy, relevance mass and rank, top-k intersection,
AUROC).

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
