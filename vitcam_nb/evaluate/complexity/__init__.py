"""Complexity: how concentrated one map is (sparseness, entropy, effective complexity).

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
