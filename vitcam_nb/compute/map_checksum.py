"""Per-image checksums of a map store: what :func:`vitcam_nb.map_many` wrote of each image (its maps, parts, their
degeneracy, scale, ids, targets and logits), hashed array by array as the batch is written, and checked on every
read of that image, so that a chunk changed on disk (a flipped byte zstd happens not to detect, an edited or deleted
chunk) is refused naming the store, the image and the array, never read back as another map.

A digest is the SHA-256 (first 16 hex digits: 64 bits, for accidental damage, not an adversary) of an array's values
as the store holds them (its dtype, little-endian; text as UTF-8), per image. The writer hashes the values cast to
the stored array's dtype (exactly what zarr writes) and the reader the values it decoded, so the two agree bitwise
whenever the chunk is intact. Stores written before checksums existed (vitcam_nb 0.2.0, 0.3.0) have no ``checksum``
array: they open as before, with a warning and ``attrs["checksums"]`` saying their maps are unverified.

Example:
    >>> digests = batch_digests({"scale": np.array([[1.0], [2.0]], np.float32)}, {"scale": np.dtype("float32")})
    >>> len(digests), sorted(digests[0]), len(digests[0]["scale"])
    (2, ['scale'], 16)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import TraceFileError

__all__ = ["CHECKED", "CHECKSUMS_ATTR", "CHECKSUM_BYTES", "CHECKSUM_VAR", "UNVERIFIED", "VERIFIED",
           "array_digest", "batch_digests", "verify_image"]

#: The per-image array holding each image's digests (a JSON object: array name -> digest).
CHECKSUM_VAR = "checksum"
#: The store (and opened Dataset) attribute that says whether its maps are verified on read.
CHECKSUMS_ATTR = "checksums"
VERIFIED = "sha256 per image and array, verified on read"
UNVERIFIED = ("none: this store was written before map stores had checksums (vitcam_nb 0.3.0 or earlier), so a "
              "chunk changed on disk cannot be detected; compute it again with vc.map_many to have them")
#: Every per-image array a map, its report or its image's facts are read from (``done`` and the index are not).
CHECKED = ("maps", "parts", "part_reason", "degenerate", "scale", "trace_id", "input_sha256", "provenance", "label",
           "source", "target_class", "target_label", "logits", "lm_maps", "lm_parts", "lm_part_reason")
#: Bytes of one image's checksum on disk, at most (16 arrays of a 16-digit digest, as JSON), for the disk check.
CHECKSUM_BYTES = 768
#: The batch entry that carries the digests of the arrays a worker wrote itself (``maps``, ``parts``).
BIG_DIGESTS = "_big_digests"


def array_digest(values: np.ndarray) -> str:
    """The digest of one image's array: its shape and values (text as UTF-8, numbers little-endian in their dtype).

    Example:
        >>> array_digest(np.zeros(2, np.float32)) == array_digest(np.zeros(2, np.float32).astype(">f4"))
        True
    """
    values = np.asarray(values)
    h = hashlib.sha256(repr(values.shape).encode())
    if values.dtype.kind in "OUST":  # zarr's text arrays read back as StringDType, numpy's U or object: same text
        h.update(b"text|" + "\x00".join(str(v) for v in values.ravel()).encode("utf-8", "surrogatepass"))
    else:
        little = values.dtype.newbyteorder("<")
        h.update(little.str.encode() + b"|" + np.ascontiguousarray(values, dtype=little).tobytes())
    return h.hexdigest()[:16]


def batch_digests(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype]) -> list[dict[str, str]]:
    """Per image of a batch (``arrays``: leading image axis), the digest of each array named in ``dtypes`` (the
    stored arrays' dtypes: the values are cast as zarr casts them when it writes).

    Example:
        >>> batch_digests({"maps": np.zeros((1, 2, 2))}, {"maps": np.dtype("float32")})[0]["maps"] == array_digest(
        ...     np.zeros((2, 2), np.float32))
        True
    """
    names = [k for k in CHECKED if k in dtypes and k in arrays]
    if not names:
        return []
    cast = {k: np.asarray(arrays[k]) if dtypes[k].kind in "OUST" else np.asarray(arrays[k], dtype=dtypes[k])
            for k in names}
    return [{k: array_digest(cast[k][b]) for k in names} for b in range(len(cast[names[0]]))]


def verify_image(one: xr.Dataset, where: str, i: int) -> None:
    """Refuse image ``i`` of a map store (loaded) whose arrays differ from the digests written with them, naming
    the store, the image and the arrays; a store without checksums (written before them) is not checked here.

    Example:
        >>> one = xr.Dataset({"scale": ("recipe", np.ones(1, np.float32))})
        >>> one["checksum"] = json.dumps({"scale": array_digest(np.ones(1, np.float32))})
        >>> verify_image(one, "m.zarr", 0)
    """
    if CHECKSUM_VAR not in one.variables:
        return
    again = "compute it again with vc.map_many(..., overwrite=True)"
    text = str(one[CHECKSUM_VAR].values)
    try:
        stored = json.loads(text) if text else None
    except ValueError:
        stored = None
    if not isinstance(stored, dict) or not stored:
        raise TraceFileError(f"path: {where} is damaged: image {i} is marked done but its checksum is "
                             f"{'missing' if not text else 'not one vc.map_many writes'}; {again}")
    bad = [k for k, digest in stored.items()
           if k not in one.variables or array_digest(np.asarray(one[k].values)) != digest]
    if bad:
        names = ", ".join(repr(k) for k in bad)
        several = len(bad) > 1
        raise TraceFileError(f"path: {where} is damaged: image {i}'s array{'s' if several else ''} {names} no longer "
                             f"match{'' if several else 'es'} the checksum written with {'them' if several else 'it'} "
                             f"(a chunk was changed on disk, deleted or truncated), so no map of that image is read; "
                             f"{again}")
