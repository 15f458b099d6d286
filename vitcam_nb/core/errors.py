"""Exceptions and warnings raised by vitcam_nb.

Every refusal names the argument, the value it got and what is allowed. Every error the kit raises is a
:class:`VitcamError` (``except vitcam_nb.VitcamError`` catches them all) and also a ``ValueError``, ``TypeError`` or
``IndexError``, so that ordinary ``except ValueError`` code catches it too. A warning points at the user's
line (:func:`user_stacklevel`), not at the package.
"""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class VitcamError(Exception):
    """Base of every error vitcam_nb raises; each is also a ``ValueError``, ``TypeError`` or ``IndexError``.

    Example:
        >>> import vitcam_nb as vc
        >>> try:
        ...     vc.Recipe(site="F9")
        ... except vc.VitcamError as e:
        ...     print(type(e).__name__)
        RecipeError
    """


class ArgumentError(VitcamError, ValueError):
    """An argument whose value is not allowed; the message names the argument, what it got and what is allowed.

    Example:
        >>> isinstance(ArgumentError("batch_size: expected an int >= 1, got 0"), ValueError)
        True
    """


class ArgumentTypeError(VitcamError, TypeError):
    """An argument of a type the function does not take; the message names the argument and the types it takes.

    Example:
        >>> isinstance(ArgumentTypeError("path: expected a str or os.PathLike, got int"), TypeError)
        True
    """


class ArgumentIndexError(VitcamError, IndexError):
    """A position outside the images, frames or cells there are; the message names the range.

    Example:
        >>> isinstance(ArgumentIndexError("index: expected an int in [0, 2], got 5"), IndexError)
        True
    """


class MissingExtraError(ArgumentError, ImportError):
    """A model (or other input) that needs an optional package which is not installed; the message names the extra
    that installs it. Also an ``ImportError``, so code that skips on a missing package catches it.

    Example:
        >>> isinstance(MissingExtraError("shapes-video needs transformers: pip install -e '.[hf]'"), ImportError)
        True
    """


class TraceError(VitcamError, ValueError):
    """Bad input to :func:`vitcam_nb.trace` or a trace that cannot be used.

    Example:
        >>> try:
        ...     raise TraceError("image: expected 3 channels, got 4")
        ... except ValueError as e:
        ...     print(e)
        image: expected 3 channels, got 4
    """


class RecipeError(VitcamError, ValueError):
    """A recipe field with a value that is unknown, mistyped or meaningless for the other choices.

    Example:
        >>> isinstance(RecipeError("weighting: ..."), ValueError)
        True
    """


class TraceFileError(VitcamError, ValueError):
    """A trace file that is truncated, corrupted, foreign or of an unsupported schema version.

    Example:
        >>> isinstance(TraceFileError("x.nc: not a vitcam_nb trace"), ValueError)
        True
    """



class OutputExistsError(TraceFileError):
    """An output path that holds a file or folder vitcam_nb did not write (or one changed since): it is left
    alone unless ``overwrite=True``. A :class:`TraceFileError`, as :func:`vitcam_nb.save` raises for the same rule.

    Example:
        >>> isinstance(OutputExistsError("path: notes.html exists ..."), TraceFileError)
        True
    """


class ExportError(VitcamError, ValueError):
    """An export argument that is not allowed, or an export that cannot be made (over its size limit, or no
    recipe of the chosen axes that the trace can give); nothing is written.

    Example:
        >>> isinstance(ExportError("max_mb: expected a number > 0, got -1"), ValueError)
        True
    """

def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first frame outside vitcam_nb.

    Example:
        >>> user_stacklevel()  # called from outside the package: the caller itself
        1
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level


class DegenerateMapWarning(UserWarning):
    """A map that carries no information (zero gradients, constant result) was returned as zeros.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("ignore", DegenerateMapWarning)
    """


class RandomWeightsWarning(UserWarning):
    """A model that has published weights was built with random-init ones: its maps explain an untrained network.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("ignore", RandomWeightsWarning)
    """


class WeightsError(VitcamError, ValueError):
    """Weights that cannot be loaded: not in the local cache while offline, not a safetensors file, or a state dict
    that does not fit the architecture.

    Example:
        >>> isinstance(WeightsError("weights: x.bin is not a safetensors file"), ValueError)
        True
    """
