"""A file of exact Shapley values for the known-answer reports, so that a report can reuse values computed once.

Exact Shapley values of an image's patch groups depend on the model's weights, the image, the grid, the baseline,
the score and the class, never on the map they are compared with: a report that ranks a new method needs no new
masked passes. An entry is keyed by the weights' SHA-256, the ``vitcam_nb.data.shapes`` seed, set size and image index,
the grid, the baseline, the score and the target class; anything else is a miss, and the values are computed.
The file is JSON (no pickle); a file that is not such a cache is refused, never overwritten.

Example:
    >>> cache = ShapleyCache(None)
    >>> cache.get(weights="ab", seed=0, n_images=1, image=0, grid=(2, 2), baseline="mean", score="logit",
    ...           target=1) is None
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.arguments import as_path
from vitcam_nb.core.errors import ArgumentError

__all__ = ["ShapleyCache"]

_FORMAT = "vitcam_nb shapley cache v1"


def _key(weights: str, seed: int, n_images: int, image: int, grid: tuple[int, int], baseline: str, score: str,
         target: int) -> str:
    # shapes(n, seed) draws a different set for each n: the set size is part of an image's name
    return (f"{weights}|shapes(n={int(n_images)},seed={int(seed)})|image={int(image)}"
            f"|grid={int(grid[0])}x{int(grid[1])}|baseline={baseline}|score={score}|target={int(target)}")


class ShapleyCache:
    """Shapley values of known-answer images in a JSON file (``path``; None: nothing read or written).

    Example:
        >>> ShapleyCache(None).hits
        0
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else as_path("shapley_cache", path)
        self.entries: dict[str, dict[str, Any]] = {}
        self.hits = 0
        self.misses = 0
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:  # a folder, unreadable, not UTF-8 or not JSON: not a cache
                raise ArgumentError(f"shapley_cache: {self.path} could not be read as a vitcam_nb Shapley cache "
                                    f"(a JSON file): {exc}; it is left alone. Give another path") from exc
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise ArgumentError(f"shapley_cache: {self.path} is not a vitcam_nb Shapley cache (expected a JSON "
                                    f"object with format {_FORMAT!r}); give another path")
            self.entries = dict(data.get("entries", {}))

    def get(self, *, weights: str, seed: int, n_images: int, image: int, grid: tuple[int, int], baseline: str,
            score: str, target: int) -> xr.DataArray | None:
        """The stored values as a ``(gy, gx)`` DataArray with their recorded attrs, or None (a miss).

        Example:
            >>> ShapleyCache(None).get(weights="w", seed=1, n_images=1, image=0, grid=(4, 4), baseline="mean",
            ...                        score="logit", target=0) is None
            True
        """
        entry = self.entries.get(_key(weights, seed, n_images, image, grid, baseline, score, target))
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        phi = np.asarray(entry["values"], dtype=np.float64)
        return xr.DataArray(phi, dims=("gy", "gx"), coords={"gy": np.arange(phi.shape[0]),
                                                            "gx": np.arange(phi.shape[1])},
                            name="shapley", attrs={**entry.get("attrs", {}), "from_cache": str(self.path)})

    def put(self, phi: xr.DataArray, *, weights: str, seed: int, n_images: int, image: int, grid: tuple[int, int],
            baseline: str, score: str, target: int) -> None:
        """Store ``phi`` (values and attrs) and rewrite the file.

        Example:
            >>> c = ShapleyCache(None)
            >>> key = dict(weights="w", seed=0, n_images=1, image=0, grid=(1, 2), baseline="mean", score="logit",
            ...            target=0)
            >>> c.put(xr.DataArray(np.zeros((1, 2)), dims=("gy", "gx")), **key)
            >>> c.get(**key).shape
            (1, 2)
        """
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in phi.attrs.items()}
        self.entries[_key(weights, seed, n_images, image, grid, baseline, score, target)] = {
            "values": np.asarray(phi.values, dtype=np.float64).tolist(), "attrs": attrs}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            body = {"format": _FORMAT, "note": "exact Shapley values (vc.evaluate.shapley_patches) keyed by weights "
                    "SHA-256, shapes() seed and set size, image index, grid, baseline, score and target class; "
                    "independent of any map", "entries": dict(sorted(self.entries.items()))}
            self.path.write_text(json.dumps(body, indent=1, default=str) + "\n")
