"""Scoring an input with arbitrary sets of cells removed: the engine of the faithfulness metrics whose removals are
not a prefix of one ranking (random subsets, one group at a time, superpixels).

Example:
    >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
    >>> s = setup(net, torch.ones(1, 3, 4, 4), np.eye(4), metric="demo", mode="token", substrate="mean",
    ...           score="logit", target=0, batch_size=8, seed=0, patch_size=2, nli_noise=0.0)
    >>> removed_scores(s, [np.array([0])], progress=False, desc="").shape
    (1,)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate.faithfulness.curves import PerturbationSetup
from vitcam_nb.evaluate.faithfulness.perturbation import show_progress
from vitcam_nb.evaluate.faithfulness.substrates import fixed_substrate, noisy_linear_imputation

__all__ = ["cell_index", "check_count", "removed_scores", "setup"]


def setup(model: torch.nn.Module, image: object, saliency: object, *, metric: str, mode: str, substrate: str,
          score: str, target: int | None, batch_size: int, seed: int, patch_size: object, nli_noise: float,
          blur_sigma: float | None = None) -> PerturbationSetup:
    """The validated settings of a removal metric (model input, cells, class), as for deletion: a trace made with
    other weights, an unknown mode/substrate/score or a bad batch size/seed is refused naming the argument.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
        >>> setup(net, torch.ones(1, 3, 2, 2), np.eye(2), metric="demo", mode="pixel", substrate="mean",
        ...       score="prob", target=None, batch_size=4, seed=0, patch_size=None, nli_noise=0.0).n_cells
        4
    """
    return PerturbationSetup(model, image, saliency, mode=mode, substrate=substrate, step=None, score=score,
                             order="morf", target=target, batch_size=batch_size, seed=seed, patch_size=patch_size,
                             blur_sigma=blur_sigma, nli_noise=nli_noise, metric=metric)


def check_count(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in ``low..high``, else a ValueError naming ``name``.

    Example:
        >>> check_count("n_groups", 10, 2, 64)
        10
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ArgumentError(f"{name}: expected an int in {low}..{high}, got {value!r}")
    return int(value)


def cell_index(s: PerturbationSetup) -> np.ndarray:
    """The cell of every input pixel (row-major cell ids), at the input size.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
        >>> s = setup(net, torch.ones(1, 3, 4, 4), np.eye(4), metric="demo", mode="token", substrate="mean",
        ...           score="logit", target=0, batch_size=8, seed=0, patch_size=2, nli_noise=0.0)
        >>> cell_index(s)[:, 0].tolist()
        [0, 0, 2, 2]
    """
    gh, gw = s.cells.shape
    fy, fx = s.shape[0] // gh, s.shape[1] // gw
    return np.repeat(np.repeat(np.arange(gh * gw).reshape(gh, gw), fy, axis=0), fx, axis=1)


def removed_scores(s: PerturbationSetup, removals: Sequence[np.ndarray], *, progress: bool | None, desc: str,
                   labels: np.ndarray | None = None) -> np.ndarray:
    """The class score of the input with each set of cells removed (cell ids, or a boolean mask over pixels when
    ``labels`` is None and the array is 2-D), in batches, with a progress bar for long runs. The NLI substrate
    draws its noise from ``SeedSequence([seed, i])`` for removal ``i``.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2, bias=False))
        >>> s = setup(net, torch.ones(1, 3, 4, 4), np.eye(4), metric="demo", mode="token", substrate="mean",
        ...           score="logit", target=0, batch_size=8, seed=0, patch_size=2, nli_noise=0.0)
        >>> removed_scores(s, [np.array([], int), np.arange(4)], progress=False, desc="").tolist()[1]
        0.0
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    x = s.x
    fixed = fixed_substrate(x, s.kw["substrate"], s.kw["blur_sigma"])
    ids = cell_index(s) if labels is None else labels
    x_np = x[0].numpy().astype(np.float64) if fixed is None else None

    def inputs() -> Iterator[torch.Tensor]:
        for i, cells in enumerate(removals):
            arr = np.asarray(cells)
            gone = arr if (arr.dtype == bool and arr.shape == s.shape) else np.isin(ids, arr)
            if not gone.any():
                yield x[0]
            elif fixed is not None:
                yield torch.where(torch.from_numpy(gone), fixed[0], x[0])
            else:
                seq = np.random.SeedSequence([s.kw["seed"], i])
                filled = noisy_linear_imputation(x_np, gone, s.kw["nli_noise"], seq)
                yield torch.from_numpy(filled.astype(np.float32))

    total, size = len(removals), s.kw["batch_size"]
    out = np.empty(total)
    stream = inputs()
    n_batches = -(-total // size)
    with tqdm(total=n_batches, desc=desc, disable=not show_progress(progress, total), leave=False) as bar:
        for b in range(n_batches):
            batch = [next(stream) for _ in range(min(size, total - b * size))]
            out[b * size: b * size + len(batch)] = s.scorer(torch.stack(batch), s.target)
            bar.update(1)
    return out
