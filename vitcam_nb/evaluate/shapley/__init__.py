"""Exact Shapley values of patch groups as a ground truth (all 2^n masked forward passes, closed formula) and the
rank agreement of a map with them.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
