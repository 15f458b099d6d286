"""Ambiguity: every recipe a description allows, their spread, and the share of map variance each open choice explains.

The public names are exported by :mod:`vitcam_nb.evaluate`.
"""
