"""The audit: the labels of its experiment (localises / context / inverted / empty), its statistics over paper cards,
and the position probe behind the checklist's raster caveat.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
