"""The shared argument checks (vitcam_nb/core/arguments.py): a path and a flag are refused by name, with the kit's
own error, for every value that pathlib or Python's truthiness would have taken or failed on in their own way."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.core.arguments import as_flag, as_path


@pytest.mark.parametrize("value", ["maps.zarr", Path("a/b.nc"), PurePosixPath("c.nc")])
def test_a_str_or_path_like_is_taken_as_a_path(value):
    assert as_path("path", value) == Path(str(value))


@pytest.mark.parametrize("value, kind", [(123, "int"), (None, "NoneType"), (b"x.nc", "bytes"), (["a"], "list")])
def test_anything_else_is_refused_by_name(value, kind):
    with pytest.raises(vc.ArgumentTypeError, match=f"^out: expected a file or folder path .*got {kind}$"):
        as_path("out", value)


def test_an_empty_string_is_refused_as_no_path():
    with pytest.raises(vc.ArgumentError, match="^path: expected a file or folder path, got an empty string$"):
        as_path("path", "")


@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_a_bool_is_a_flag(value):
    assert as_flag("overwrite", value) is bool(value)


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, [True]])
def test_a_truthy_or_falsy_non_bool_is_refused(value):
    with pytest.raises(vc.ArgumentTypeError, match="^overwrite: expected True or False, got "):
        as_flag("overwrite", value)


def test_a_store_path_ends_in_zarr_and_its_folder_exists(tmp_path):
    from vitcam_nb.core.arguments import as_store_path

    assert as_store_path(str(tmp_path / "s.zarr"), "a map_many store") == tmp_path / "s.zarr"
    # issue 52: the suffix exactly (x.ZARR is another folder than x.zarr where names are case-sensitive)
    with pytest.raises(vc.TraceFileError, match=r"^path: a map_many store is a zarr folder and its path ends in .zarr "
                                                r"\(lower case\), got .*s.ZARR$"):
        as_store_path(str(tmp_path / "s.ZARR"), "a map_many store")
    with pytest.raises(vc.TraceFileError, match="^path: a map_many store is a zarr folder .* got .*s.nc$"):
        as_store_path(tmp_path / "s.nc", "a map_many store")
    with pytest.raises(vc.TraceFileError, match="^path: folder .*missing does not exist$"):
        as_store_path(tmp_path / "missing" / "s.zarr", "a map_many store")
    with pytest.raises(vc.ArgumentTypeError, match="^path: "):
        as_store_path(7, "a map_many store")
