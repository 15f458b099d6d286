"""Issue #52, LOW: ``export_html`` replaces a page it wrote only while nobody changed it: a page ends with the SHA-256
of its bytes, and a page edited since (a user's notes added) is refused by path unless ``overwrite=True``."""

from __future__ import annotations

import hashlib
import re

import pytest
from store_trace import TRACE

import vitcam_nb as vc

AXES = {"site": ["F1"], "layer": [-1], "weighting": ["gradcam"]}


def test_a_page_edited_since_it_was_exported_is_not_replaced(tmp_path, capsys):
    path = tmp_path / "page.html"
    vc.export_html(TRACE, path, axes=AXES, title="first", progress=False)
    data = path.read_bytes()
    seal = re.search(rb"<!-- vitcam_nb export_html sha256 ([0-9a-f]{64}) -->\n\Z", data)
    assert seal and hashlib.sha256(data[:seal.start() - 1]).hexdigest() == seal.group(1).decode()
    vc.export_html(TRACE, path, axes=AXES, title="second", progress=False)  # its own page, unchanged: replaced
    assert b"second" in path.read_bytes()
    edited = path.read_bytes().replace(b"</body>", b"<p>my notes on this map</p></body>")
    path.write_bytes(edited)
    with pytest.raises(vc.OutputExistsError, match=rf"^path: {path} is a page export_html wrote, changed since"):
        vc.export_html(TRACE, path, axes=AXES, title="third", progress=False)
    assert path.read_bytes() == edited
    vc.export_html(TRACE, path, axes=AXES, title="third", progress=False, overwrite=True)
    assert b"third" in path.read_bytes() and b"my notes" not in path.read_bytes()
