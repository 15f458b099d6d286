"""Which model names the kit knows, told without importing torch: the bundled models (read from the package's model
cards) and, only for a name that is not bundled, timm's; a misspelt name gets the closest known one as a suggestion.
The command line checks ``--model`` and ``--image`` with :func:`check_model` before any work, and so does
:func:`vitcam_nb.demo.run_demo`.

Example:
    >>> "shapes-vit" in bundled_model_names()
    True
"""

from __future__ import annotations

import difflib
from importlib.util import find_spec
from pathlib import Path

from vitcam_nb.core.errors import ArgumentError

__all__ = ["bundled_model_names", "check_model"]


def bundled_model_names() -> list[str]:
    """The bundled models' names, read from the package's model cards without importing torch (the same list as
    :func:`vitcam_nb.models.bundled_names`).

    Example:
        >>> "shapes-vit" in bundled_model_names()
        True
    """
    spec = find_spec("vitcam_nb.data")  # finds the folder without running the package (which imports torch)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted({p.stem for folder in folders for p in (Path(folder) / "models").glob("*.json")})


def _timm_knows(name: str) -> bool:
    import timm
    from timm.models import split_model_name_tag

    if name.startswith(("hf-hub:", "hf_hub:", "local-dir:")):  # resolved by timm at build time, not by its registry
        return True
    return bool(timm.is_model(split_model_name_tag(name)[0]))


def check_model(name: str, image: str | None = None, *, image_needed: bool = True) -> str:
    """Refuse (:class:`~vitcam_nb.ArgumentError`) a ``--model`` that is neither bundled nor a timm name, with the
    closest bundled (else timm) name as a suggestion, and a timm name without ``--image`` where ``image_needed`` or
    with an ``--image`` that is not a file; return ``"bundled"`` or ``"timm"``. Only a name that is not bundled imports
    timm, and only an unknown one lists timm's models.

    Example:
        >>> check_model("shapes-vit")
        'bundled'
        >>> check_model("shapes_vit")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        ArgumentError: model: unknown model 'shapes_vit' ...; did you mean 'shapes-vit'?
    """
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"model: expected a bundled model name or a timm model name, got {name!r}")
    bundled = bundled_model_names()
    if name in bundled:  # its own command says what it does with an image (the video demo refuses one)
        return "bundled"
    if not _timm_knows(name):
        close = difflib.get_close_matches(name, bundled, n=1, cutoff=0.6)
        if not close:
            import timm

            close = difflib.get_close_matches(name, timm.list_models(), n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ArgumentError(f"model: unknown model {name!r}: not a bundled model ({', '.join(bundled)}) nor a model "
                            f"name timm knows (timm.list_models() lists them){hint}")
    if image_needed and image is None:
        raise ArgumentError(f"image: a timm model ({name}) needs --image PATH; the bundled sample images are for the "
                            f"bundled models ({', '.join(bundled)})")
    if image is not None and not Path(image).is_file():
        raise ArgumentError(f"image: {image} is not a file")
    return "timm"
