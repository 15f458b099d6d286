"""Agreement: two maps on one grid -> a number, and the atlas of many recipes' pairwise agreement.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
