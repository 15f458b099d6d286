"""Score cards: every recipe x every registered metric over many images, and their plots.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
