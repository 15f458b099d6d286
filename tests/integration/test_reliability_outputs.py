"""The kit never overwrites or deletes a file it did not write: ``vitcam-nb ambiguity``, ``vitcam-nb figure``, the
known-answer reports and the demo refuse a file of their outputs' names that they did not write there (or that
changed since) before any work and keep it byte for byte, replace their own outputs on a rerun and anything with
``overwrite=True`` / ``--overwrite``; an ``overwrite`` that is not True or False is refused, and a refused call
creates nothing."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb import audit, audit_figure, demo
from vitcam_nb.cli import main
from vitcam_nb.core.outfiles import MANIFEST
from vitcam_nb.evaluate.report import known_answer, known_answer_detection, presets

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")

MINE = b"a user's own results\n"
PNG = b"\x89PNG\r\n\x1a\n"
# A description that leaves little open: the ambiguity runs in about a second on shapes-vit.
NARROW = {"site": "F1", "layer": -1, "weighting": "gradcam", "target": "logit", "weight_tokens": "patch",
          "relu": "after", "heads": "channels"}
NARROW_ARGS = ["--reported", *(f"{k}={v}" for k, v in NARROW.items())]
# One map on one bundled image: the figure's smallest run.
TINY = ["--model", "shapes-vit", "--images", "1", "--no-photo", "--quiet", "--axes", "site=F1", "--axes",
        "weighting=gradcam", "--axes", "heads=channels", "--axes", "weight_tokens=patch", "--axes", "target=logit"]
NOT_A_FLAG = r"^overwrite: expected True or False, got 'no'"


def listing(folder: Path) -> list[str]:
    """Every name in ``folder``, hidden ones (the manifest, a temporary file left behind) included."""
    return sorted(p.name for p in folder.iterdir())


def refused_message(name: str) -> str:
    return rf"{re.escape(name)} exists and is not a file vitcam_nb wrote there .* overwrite=True"


def no_work(*args, **kwargs):
    raise AssertionError("the work started before the outputs were checked")


def recorded(folder: Path) -> dict[str, str]:
    """The manifest's checksums, checked against the files they name."""
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert files == {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in files}
    return files


# -- vitcam-nb ambiguity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ambiguity.png", "ambiguity.json"])
def test_ambiguity_refuses_a_users_file_before_the_model_is_built(tmp_path, monkeypatch, capsys, name):
    (tmp_path / name).write_bytes(MINE)
    monkeypatch.setattr(audit, "load_model", no_work)
    with pytest.raises(vc.OutputExistsError, match=refused_message(name)):
        audit.run_ambiguity(tmp_path, reported=NARROW)
    assert main(["ambiguity", "--out", str(tmp_path), *NARROW_ARGS]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitcam-nb ambiguity: path: ") and name in err and "--overwrite" in err
    assert (tmp_path / name).read_bytes() == MINE and listing(tmp_path) == [name]


def test_ambiguity_replaces_its_own_outputs_and_overwrite_replaces_a_users(tmp_path, capsys):
    import matplotlib.pyplot as plt

    out = tmp_path / "amb"
    open_figures = plt.get_fignums()
    assert main(["ambiguity", "--out", str(out), *NARROW_ARGS]) == 0
    assert sorted(recorded(out)) == ["ambiguity.json", "ambiguity.png"]
    assert plt.get_fignums() == open_figures  # the figure went to its file and was closed
    wider = [a for a in NARROW_ARGS if not a.startswith("relu=")]  # relu left open: a different summary
    assert main(["ambiguity", "--out", str(out), *wider]) == 0  # its own outputs: replaced
    assert json.loads((out / "ambiguity.json").read_text())["reported"] == {k: v for k, v in NARROW.items()
                                                                           if k != "relu"}
    recorded(out)
    (out / "ambiguity.png").write_bytes(MINE)  # the user's now
    assert main(["ambiguity", "--out", str(out), *wider]) == 2
    assert "ambiguity.png" in capsys.readouterr().err and (out / "ambiguity.png").read_bytes() == MINE
    assert main(["ambiguity", "--out", str(out), *wider, "--overwrite"]) == 0
    assert (out / "ambiguity.png").read_bytes()[:8] == PNG and sorted(recorded(out)) == ["ambiguity.json",
                                                                                         "ambiguity.png"]
    assert listing(out) == [MANIFEST, "ambiguity.json", "ambiguity.png"]  # no temporary file left


# -- vitcam-nb figure ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", audit_figure.FILES)
def test_figure_refuses_a_users_file_beside_its_own_other_output(tmp_path, monkeypatch, capsys, name):
    out = tmp_path / "fig"
    assert main(["figure", "--out", str(out), *TINY]) == 0
    assert main(["figure", "--out", str(out), *TINY]) == 0  # its own outputs: replaced
    (out / name).write_bytes(MINE)  # the user's now; the other file is still the kit's
    with monkeypatch.context() as patch:
        patch.setattr(audit_figure, "_choose_model", no_work)
        assert main(["figure", "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err
    assert name in err and "--overwrite" in err and (out / name).read_bytes() == MINE
    assert main(["figure", "--out", str(out), *TINY, "--overwrite"]) == 0
    assert (out / "audit_figure.png").read_bytes()[:8] == PNG
    assert json.loads((out / "audit_figure.json").read_text())["maps"] == 1
    assert sorted(recorded(out)) == sorted(audit_figure.FILES) and listing(out) == sorted([MANIFEST,
                                                                                           *audit_figure.FILES])


# -- the known-answer reports ----------------------------------------------------------------------------------
REPORTS = {
    "known_answer": (known_answer, known_answer.report_known_answer,
                     {"n_images": 1, "sites": ["F1"], "weightings": ["gradcam"], "targets": ["logit"],
                      "deletion_steps": 2, "progress": False},
                     ("known_answer_report.csv", "known_answer_report.png", "known_answer_report.json")),
    "presets": (presets, presets.report_presets,
                {"n_images": 1, "names": ["gradcam"], "deletion_steps": 2, "progress": False},
                ("presets.csv", "presets.json")),
}


@pytest.mark.parametrize("report", REPORTS)
def test_a_report_refuses_a_users_file_before_any_work(tmp_path, monkeypatch, report):
    module, run, kwargs, names = REPORTS[report]
    monkeypatch.setattr(module, "load_model", no_work)
    monkeypatch.setattr(module, "trace", no_work)
    for name in names:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(MINE)
        with pytest.raises(vc.OutputExistsError, match=refused_message(name)):
            run("shapes-vit", out_dir=folder, **kwargs)
        assert (folder / name).read_bytes() == MINE and listing(folder) == [name]


@pytest.mark.parametrize("report", REPORTS)
def test_a_report_replaces_its_own_files_and_overwrite_replaces_a_users(tmp_path, report):
    _module, run, kwargs, names = REPORTS[report]
    out = tmp_path / "r"
    model = vc.load_model("shapes-vit")
    run(model, out_dir=out, seed=0, **kwargs)
    run(model, out_dir=out, seed=1, **kwargs)  # its own files: replaced
    settings = out / names[-1]
    assert json.loads(settings.read_text())["seed"] == 1 and sorted(recorded(out)) == sorted(names)
    (out / names[0]).write_bytes(MINE)  # the user's now
    with pytest.raises(vc.OutputExistsError, match=refused_message(names[0])):
        run(model, out_dir=out, seed=2, **kwargs)
    assert (out / names[0]).read_bytes() == MINE and json.loads(settings.read_text())["seed"] == 1
    run(model, out_dir=out, seed=2, overwrite=True, **kwargs)
    assert json.loads(settings.read_text())["seed"] == 2 and sorted(recorded(out)) == sorted(names)
    assert (out / names[0]).read_bytes() != MINE and listing(out) == sorted([MANIFEST, *names])


def test_the_detection_report_replaces_a_users_file_only_with_overwrite(tmp_path):
    mine = tmp_path / "known_answer_detection.csv"
    mine.write_bytes(MINE)
    with pytest.raises(vc.OutputExistsError, match=refused_message(mine.name)):
        known_answer_detection.report_known_answer_detection(n_images=1, out_dir=tmp_path)
    assert mine.read_bytes() == MINE
    known_answer_detection.report_known_answer_detection(n_images=1, out_dir=tmp_path, overwrite=True)
    assert mine.read_text().startswith("recipe,image,detection")
    assert sorted(recorded(tmp_path)) == ["known_answer_detection.csv", "known_answer_detection.json"]


# -- the demo ------------------------------------------------------------------------------------------------------
def test_a_demo_refused_after_its_model_loaded_leaves_no_folder(tmp_path, capsys):
    """The segmentation model is refused an image of the user's once it is loaded: the folder is not made."""
    image = tmp_path / "in.png"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(image)
    out = tmp_path / "new" / "demo"
    assert main(["demo", "--out", str(out), "--model", "shapes-vit-seg", "--image", str(image), "--quiet"]) == 2
    assert "leave out --image" in capsys.readouterr().err and not (tmp_path / "new").exists()


# -- refused calls create nothing ------------------------------------------------------------------------------
def _export(out: Path, **kwargs):
    model = make_model("vit")
    tr = vc.trace(model, np.zeros((32, 32, 3), np.uint8), targets="top1")
    return vc.export_html(tr, out / "e.html", axes={"site": ["F1"], "layer": [-1]}, progress=False, **kwargs)


REFUSED = {
    "ambiguity overwrite='no'": (lambda out: audit.run_ambiguity(out, reported=NARROW, overwrite="no"),
                                 vc.ArgumentTypeError, NOT_A_FLAG),
    "ambiguity missing image": (lambda out: audit.run_ambiguity(out, "vit_tiny_patch16_224", image="/nonexistent.png"),
                                vc.ArgumentError, r"^image: /nonexistent.png is not a file"),
    "figure overwrite='no'": (lambda out: audit_figure.run_figure(out, model="shapes-vit", images=1, photo=False,
                                                                  overwrite="no", progress=False),
                              vc.ArgumentTypeError, NOT_A_FLAG),
    "known_answer overwrite='no'": (lambda out: known_answer.report_known_answer(
        "shapes-vit", **REPORTS["known_answer"][2], out_dir=out, overwrite="no"), vc.ArgumentTypeError, NOT_A_FLAG),
    "presets overwrite='no'": (lambda out: presets.report_presets(
        "shapes-vit", **REPORTS["presets"][2], out_dir=out, overwrite="no"), vc.ArgumentTypeError, NOT_A_FLAG),
    "detection overwrite='no'": (lambda out: known_answer_detection.report_known_answer_detection(
        n_images=1, out_dir=out, overwrite="no"), vc.ArgumentTypeError, NOT_A_FLAG),
    "demo overwrite='no'": (lambda out: demo.run_demo(out, progress=False, overwrite="no"),
                            vc.ArgumentTypeError, NOT_A_FLAG),
    "video demo overwrite='no'": (lambda out: demo.run_demo(out, "shapes-video", progress=False, overwrite="no"),
                                  vc.ArgumentTypeError, NOT_A_FLAG),
    "demo missing image": (lambda out: demo.run_demo(out, image="/nonexistent.png", progress=False),
                           vc.ArgumentError, r"^image: /nonexistent.png is not a file"),
    "demo timm model without image": (lambda out: demo.run_demo(out, "vit_tiny_patch16_224", progress=False),
                                      vc.ArgumentError, r"^image: a timm model \(vit_tiny_patch16_224\) needs --image"),
    "export_html overwrite='no'": (lambda out: _export(out, overwrite="no"), vc.ArgumentTypeError, NOT_A_FLAG),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_call_creates_nothing(tmp_path, case):
    call, error, message = REFUSED[case]
    out = tmp_path / "new" / "out"
    with pytest.raises(error, match=message):
        call(out)
    assert listing(tmp_path) == []


def test_an_overwrite_that_is_not_a_bool_never_replaces_a_users_file(tmp_path):
    (tmp_path / "e.html").write_bytes(MINE)
    (tmp_path / "ambiguity.json").write_bytes(MINE)
    with pytest.raises(vc.ArgumentTypeError, match=NOT_A_FLAG):
        _export(tmp_path, overwrite="no")
    with pytest.raises(vc.ArgumentTypeError, match=NOT_A_FLAG):
        audit.run_ambiguity(tmp_path, reported=NARROW, overwrite="no")
    assert (tmp_path / "e.html").read_bytes() == MINE and (tmp_path / "ambiguity.json").read_bytes() == MINE
    assert listing(tmp_path) == ["ambiguity.json", "e.html"]
