"""``vitcam-nb cam TRACE "RECIPE"`` regenerates a map from a trace file and a pasted recipe line: the printed line
and ids are the recipe's, the picture is written, a file the command did not write is left alone."""

from __future__ import annotations

import numpy as np
from PIL import Image
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.cli import main


def test_cam_regenerates_the_map_of_a_pasted_line(tmp_path, capsys):
    tr = vc.trace(make_model("vit"), np.random.default_rng(6).integers(0, 255, (32, 32, 3), dtype=np.uint8),
                  targets="top2")
    path = vc.save(tr, tmp_path / "t.nc")
    recipe = vc.Recipe(site="F2", layer=-1, heads="max")
    out = tmp_path / "map.png"
    assert main(["cam", str(path), recipe.to_string(), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"recipe:       {recipe.resolve(tr).to_string()}" in printed
    assert f"recipe id:    {recipe.id} (as written); canonical id {recipe.canonical_id(tr)}" in printed
    assert tr.attrs["trace_id"] in printed and vc.cam(tr, recipe).attrs["methods"] in printed
    assert Image.open(out).info["Software"].startswith("vitcam_nb cam")
    assert main(["cam", str(path), "F1@0", "--out", str(out)]) == 0  # its own picture is replaced

    notes = tmp_path / "notes.png"
    notes.write_bytes(b"mine")
    assert main(["cam", str(path), "F1@0", "--out", str(notes)]) == 2
    assert notes.read_bytes() == b"mine" and "not a map picture vitcam_nb wrote" in capsys.readouterr().err
    assert main(["cam", str(path), "F1@0 banana", "--out", str(tmp_path / "x.png")]) == 2
    assert "cannot read 'banana'" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
