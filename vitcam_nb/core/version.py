"""The package version, kept low so that every layer can stamp it into what it writes.

Example:
    >>> __version__.count(".")
    2
"""

__version__ = "0.3.0"
