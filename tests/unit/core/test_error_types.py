"""Every error the kit raises is its own type (``vc.VitcamError``) and keeps the built-in type it had in 0.1
(``ValueError``, ``TypeError``, ``IndexError``), so both ``except vc.VitcamError`` and old ``except ValueError``
code catch it (vitcam_nb/core/errors.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.core import card_schema, errors

PACKAGE = Path(vc.__file__).parent
BUILT_IN = {"ValueError", "TypeError", "IndexError", "KeyError", "LookupError"}


def _built_in_raises(source: str) -> list[int]:
    """Line numbers of ``raise ValueError(...)`` and the like: a built-in exception class raised by name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILT_IN:
                lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_a_built_in_raise():
    assert _built_in_raises("def f(x):\n    if x:\n        raise ValueError('x')\n    raise TypeError\n") == [3, 4]
    assert _built_in_raises("raise vc.ArgumentError('x')\ntry:\n    pass\nexcept ValueError:\n    raise\n") == []


def test_no_module_of_the_package_raises_a_built_in_error_by_name():
    found = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if (lines := _built_in_raises(path.read_text()))}
    assert found == {}


def test_every_error_class_is_a_vitcam_error_and_a_built_in_one():
    classes = [c for module in (errors, card_schema) for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, Exception) and not issubclass(c, Warning) and c.__module__ == module.__name__]
    assert {c.__name__ for c in classes} >= {"VitcamError", "ArgumentError", "ArgumentTypeError", "ArgumentIndexError",
                                             "TraceError", "RecipeError", "TraceFileError", "OutputExistsError",
                                             "ExportError", "WeightsError", "PaperCardError"}
    for c in classes:
        assert issubclass(c, vc.VitcamError), c
        if c is not vc.VitcamError:
            assert issubclass(c, (ValueError, TypeError, IndexError)), c
    # 0.1's refusals keep their type
    for c in (vc.TraceError, vc.RecipeError, vc.TraceFileError, vc.ExportError, vc.WeightsError, vc.ArgumentError):
        assert issubclass(c, ValueError)
    assert issubclass(vc.ArgumentTypeError, TypeError) and issubclass(vc.ArgumentIndexError, IndexError)
    assert issubclass(vc.OutputExistsError, vc.TraceFileError)


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, np.ndarray]:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5).eval()
    return model, np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def test_public_refusals_are_caught_as_vitcam_errors_and_as_their_built_in_type(tiny, tmp_path):
    model, image = tiny
    store = tmp_path / "maps.zarr"
    with pytest.raises(vc.ArgumentTypeError, match="recipes_or_space: expected a list of Recipes") as err:
        vc.map_many(model, image[None], None, store)
    assert isinstance(err.value, TypeError) and not store.exists()
    tr = vc.trace(model, image, targets="top1")
    with pytest.raises(vc.VitcamError, match="recipe") as err:
        vc.cam(tr, 5)
    assert isinstance(err.value, (TypeError, ValueError))
    vc.map_many(model, image[None], ["gradcam"], store, progress=False)
    with pytest.raises(vc.ArgumentIndexError, match=r"i: expected an image position in \[0, 0\], got 7") as err:
        vc.image_maps(vc.open_maps(store), 7)
    assert isinstance(err.value, IndexError)
