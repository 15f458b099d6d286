"""Robustness: how much the maps move under small input perturbations (sensitivity, Lipschitz, relative stability).

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
