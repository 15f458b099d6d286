"""Reports: the known-answer ranking of every variant, and of the published presets.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
