"""Randomisation: model-parameter randomisation (cascading, smooth and efficient MPRT) and the randomised-logit check.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
