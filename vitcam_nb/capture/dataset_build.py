"""One trace Dataset built in one step: the same Dataset ``xr.Dataset(data_vars, coords=coords, attrs=attrs)`` gives
(the same variables in the same order, the same default index on every dimension coordinate, the same dims and
attributes), without the constructor's merge and alignment of 40-odd variables, which cost about as much as the
forward pass of a 10-ms model (issue 55's trace-cost row).

Example:
    >>> import numpy as np
    >>> ds = dataset({"a": (("x",), np.arange(2.0))}, {"x": ("x", np.arange(2)), "k": ("x", np.array(["p", "q"]))},
    ...              {"n": 1})
    >>> ds.identical(xr.Dataset({"a": (("x",), np.arange(2.0))},
    ...              coords={"x": ("x", np.arange(2)), "k": ("x", np.array(["p", "q"]))}, attrs={"n": 1}))
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

__all__ = ["dataset"]


def _construct(data_vars: Mapping[str, Any], coords: Mapping[str, Any], attrs: Mapping[str, Any]) -> xr.Dataset:
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


#: Default indexes already made, by (name, dtype, values): a trace's layer, token, channel, y, x ... coordinates are
#: the same from one call to the next, and making a pandas index is most of the direct build's cost. An index is
#: immutable (xarray shares one between a Dataset and its copies); each Dataset still gets variables of its own.
_INDEXES: dict[tuple, Any] = {}
_INDEXES_MAX = 256


def _index(kind: type, name: str, var: xr.Variable) -> Any:
    values = var.values
    if values.dtype.hasobject:  # no byte key for objects: made each time
        return kind.from_variables({name: var}, options={})
    key = (name, values.dtype.str, values.shape, values.tobytes())
    index = _INDEXES.get(key)
    if index is None:
        if len(_INDEXES) >= _INDEXES_MAX:
            _INDEXES.pop(next(iter(_INDEXES)))  # the oldest first
        index = _INDEXES[key] = kind.from_variables({name: var}, options={})
    return index


def _variable(spec: tuple) -> xr.Variable:
    """``xr.Variable(*spec)``. A plain numpy array of numbers or strings is what the constructor's data check keeps as
    it is (``as_compatible_data``: ``np.asarray`` of it, no object or datetime conversion, no pandas wrapper), so it
    is handed over without the check (``fastpath``): the same Variable, a few microseconds sooner, times 40-odd."""
    data = spec[1]
    if type(data) is np.ndarray and data.dtype.kind not in "OMm":
        return xr.Variable(spec[0], data, *spec[2:], fastpath=True)
    return xr.Variable(*spec)


def _plain(spec: Any) -> bool:
    # (dims, values) or (dims, values, attrs) with dims a str or a tuple of str: all the assembly writes; anything
    # else takes the constructor
    return isinstance(spec, tuple) and (len(spec) == 2 or (len(spec) == 3 and isinstance(spec[2], dict))) and (
        isinstance(spec[0], str) or (isinstance(spec[0], tuple) and all(isinstance(d, str) for d in spec[0])))


#: Whether this xarray's direct constructor gives what its public constructor gives (checked once per process on a
#: sample with every kind of entry a trace has): the direct build uses xarray internals, so an xarray whose internals
#: differ falls back to the public constructor instead of building another Dataset.
_DIRECT_OK: bool | None = None


def _direct_agrees() -> bool:
    global _DIRECT_OK
    if _DIRECT_OK is None:
        sample = ({"a": (("x", "y"), np.arange(6.0).reshape(2, 3), {"u": "v"}),
                   "b": ("y", np.arange(3, dtype=np.int8))},
                  {"x": ("x", np.array(["p", "q"])), "y": ("y", np.arange(3)), "k": ("x", np.array([1.5, 2.5]))},
                  {"n": 1, "s": "t"})
        try:
            got = _direct(*sample)
            want = xr.Dataset(sample[0], coords=sample[1], attrs=sample[2])
            _DIRECT_OK = bool(got is not None and got.identical(want) and list(got.variables) == list(
                want.variables) and list(got.coords) == list(want.coords) and all(
                got.indexes[d].equals(want.indexes[d]) for d in want.indexes) and dict(got.sizes) == dict(want.sizes))
        except Exception:  # any failure of the internals means: use the public constructor
            _DIRECT_OK = False
        _INDEXES.clear()  # the sample's indexes are not a trace's
    return _DIRECT_OK


def dataset(data_vars: Mapping[str, Any], coords: Mapping[str, Any], attrs: Mapping[str, Any]) -> xr.Dataset:
    """``xr.Dataset(data_vars, coords=coords, attrs=attrs)`` for (dims, values[, attrs]) entries, built directly: each
    dimension coordinate's default pandas index made as the constructor makes it, every other variable as it is.
    Anything the direct build does not cover (another kind of entry, a name in both, sizes that disagree, an
    xarray without the direct constructor) goes to the constructor itself, which then says what is wrong.

    Example:
        >>> import numpy as np
        >>> dataset({"a": ("x", np.zeros(2))}, {"x": ("x", np.arange(2))}, {}).indexes["x"].tolist()
        [0, 1]
    """
    built = _direct(data_vars, coords, attrs) if _direct_agrees() else None
    return _construct(data_vars, coords, attrs) if built is None else built


def _direct(data_vars: Mapping[str, Any], coords: Mapping[str, Any], attrs: Mapping[str, Any]) -> xr.Dataset | None:
    """The direct build, or None where it does not apply (the constructor then builds, and names any conflict)."""
    direct = getattr(xr.Dataset, "_construct_direct", None)
    if direct is None or set(data_vars) & set(coords) or not all(
            _plain(s) for s in (*data_vars.values(), *coords.values())):
        return None
    try:
        from xarray.core.indexes import PandasIndex
    except ImportError:
        return None
    # The constructor's order: the data variables first, then the coordinates.
    variables = {name: _variable(spec) for name, spec in data_vars.items()}
    dims: dict[str, int] = {}
    indexes: dict[str, Any] = {}
    for name, spec in coords.items():
        var = _variable(spec)
        if var.dims == (name,):  # a dimension coordinate: its default index, and the variable the index makes
            index = _index(PandasIndex, name, var)
            indexes[name] = index
            var = index.create_variables({name: var})[name]
        variables[name] = var
    for var in variables.values():
        for d, n in zip(var.dims, var.shape):
            if dims.setdefault(d, n) != n:  # the constructor's own error names the conflict
                return None
    return direct(variables, set(coords), dims, dict(attrs), indexes)
